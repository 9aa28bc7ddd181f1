import sys

from nvplug.cli.main import main

sys.exit(main())
