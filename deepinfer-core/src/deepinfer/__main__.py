"""``python -m deepinfer serve|bench ...``: the ``deepinfer`` command."""

from deepinfer.entrypoints.cli import main

main()
