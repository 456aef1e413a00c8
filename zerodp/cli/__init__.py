"""Entry points: the `zerodp` command (`commands`: train, config and the dispatch to every other
subcommand), `zerodp prepare` (`prepare`), `zerodp generate` and `zerodp eval` (`use`).

Layer: the top. It may import every other layer; nothing imports it. Importing it stays light (no
torch): `zerodp --help` and `zerodp plan` never import torch.
"""

from zerodp.cli.commands import main

__all__ = ["main"]
