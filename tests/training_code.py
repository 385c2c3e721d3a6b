"""The reference engine's training code lives in tools/train_reference/, outside the installed
package; the tests that check it import it through :func:`train_reference`."""
import importlib
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def train_reference(module: str):
    """``train_reference.<module>`` from this checkout's tools/ folder."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(f"train_reference.{module}")
