import sys

from gptkit.cli import main

sys.exit(main())
