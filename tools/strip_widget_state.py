"""Drop ipywidgets' saved state from executed notebooks: python tools/strip_widget_state.py NB...

A notebook executed by nbconvert stores each widget's state (metadata.widgets) and a
widget-view output per displayed widget. Neither can be compared by nbval, both change with
every run, and the state is large: a fresh kernel redraws the widgets anyway.
"""
import json
import sys


def strip(path: str) -> bool:
    with open(path) as f:
        nb = json.load(f)
    changed = nb["metadata"].pop("widgets", None) is not None
    for cell in nb["cells"]:
        outputs = cell.get("outputs", [])
        kept = [o for o in outputs
                if "application/vnd.jupyter.widget-view+json" not in o.get("data", {})]
        if len(kept) != len(outputs):
            cell["outputs"], changed = kept, True
    if changed:
        with open(path, "w") as f:
            json.dump(nb, f, indent=1, ensure_ascii=False)
            f.write("\n")
    return changed


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(f"{p}: {'stripped' if strip(p) else 'no widget state'}")
