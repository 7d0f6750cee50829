"""convserve: the causal depthwise conv1d stage of Mamba and hybrid LLMs as a GPU microservice.

Subpackages (each a top-level folder of the repository, linked under ``src/convserve/``):

- ``convserve.clients``: the Python client, the wire protocol (``convserve.clients.protocol``) and the load tester;
  needs no torch, triton or web server.
- ``convserve.kernels``: the Triton kernels and their PyTorch references.
- ``convserve.state_pool``: the conv-state pool.
- ``convserve.service``: the engine, scheduler and HTTP app (``pip install 'convserve[server]'``).
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("convserve")
except PackageNotFoundError:  # run from a checkout without installing
    __version__ = "0+unknown"
