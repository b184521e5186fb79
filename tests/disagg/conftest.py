import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))  # live_server.LiveServer
