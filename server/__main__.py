"""``python -m sgl_kvevict.server --model smollm2 [--port 30000] [--kv-evict-policy NAME] [sglang flags]``."""

import sys

from sgl_kvevict.server.launcher import main

sys.exit(main())
