"""asyncsess local backend: a torch + peft LoRA engine, run in-process (``local://``) or as an HTTP worker (``http://``)."""

__version__ = "0.1.0"
