"""Servers that put other clients' protocols in front of asyncsess backends (the doors of the hub).

Import the submodules directly; they need the ``serve`` extra (FastAPI, uvicorn).
"""
