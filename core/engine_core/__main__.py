"""``python -m openinfer.engine_core``: the engine-core process (see ``process``)."""

import sys

from openinfer.engine_core.process import main

sys.exit(main())
