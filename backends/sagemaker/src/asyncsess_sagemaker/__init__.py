"""asyncsess backend for Amazon SageMaker AI training sessions, and a local emulator of their wire protocol.

``sagemaker://us-west-2?role_arn=...`` selects :class:`asyncsess_sagemaker.driver.SageMakerBackend`;
``asyncsess sagemaker emulate`` (or :func:`asyncsess_sagemaker.emulator.serve`) runs the emulator.
"""

__all__ = ["SageMakerBackend"]


def __getattr__(name: str):  # keep ``import asyncsess_sagemaker`` free of boto3 until the driver is used
    if name == "SageMakerBackend":
        from .driver import SageMakerBackend

        return SageMakerBackend
    raise AttributeError(name)
