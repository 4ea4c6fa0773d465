"""Write tests/fixtures/execution_model.txt: a long natural English text for perplexity measurements.

The text is the "Execution model" chapter of the Python Language Reference, as CPython ships it in its
standard library (`pydoc_data.topics.topics["execmodel"]`, Python Software Foundation License). It
needs no download; the committed file came from CPython 3.11.7.
"""

import sys
from pathlib import Path
from pydoc_data.topics import topics

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "execution_model.txt"

if __name__ == "__main__":
    OUT.write_text(topics["execmodel"], encoding="utf-8")
    print(f"{OUT.name}: {len(topics['execmodel'])} characters from CPython {sys.version.split()[0]}")
