import sys

from zerodp.cli.commands import main

sys.exit(main())
