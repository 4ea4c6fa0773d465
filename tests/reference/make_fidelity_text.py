"""Write tests/fixtures/execution_model.txt: the opening of the "Execution model" chapter of the Python
Language Reference (PSF documentation licence), as CPython's standard library ships it in
pydoc_data.topics["execmodel"] -- the text kv-bench --fidelity runs by default. The tests use this
committed excerpt so their figures do not move with the Python version."""

from pathlib import Path
from pydoc_data.topics import topics

CHARS = 4000  # about 800 SmolLM2 tokens

if __name__ == "__main__":
    text = topics["execmodel"][:CHARS]
    out = Path(__file__).resolve().parents[1] / "fixtures" / "execution_model.txt"
    out.write_text(text[: text.rfind("\n\n")] + "\n", encoding="utf-8")
