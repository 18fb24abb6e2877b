"""nbval over the notebooks compares the values a solution's `show` calls publish the way the
grader does (minitron/grade/judge.py): each within the tolerance it carries, not digit for digit,
since the last digits of a float32 sum differ from one CPU to another. Every other output is
still compared exactly, as nbval does."""
import json

from minitron.grade.judge import Shown, compare
from minitron.grade.values import VALUE_MIME


def _shown(outputs) -> list[Shown]:
    return [Shown.from_data(json.loads(json.dumps(o["data"][VALUE_MIME])))   # plain dicts
            for o in outputs if VALUE_MIME in o.get("data", {})]


def _without_values(outputs) -> list:
    """The outputs with each shown value left out, its text form too (compared in _shown)."""
    return [o for o in outputs if VALUE_MIME not in o.get("data", {})]


def _compare_within_tolerance(nbval_compare):
    def compare_outputs(self, test, ref, skip_compare=None):
        same = nbval_compare(self, _without_values(test), _without_values(ref), skip_compare)
        found = compare(_shown(test), _shown(ref))           # after: nbval resets the traceback
        if found:
            self.comparison_traceback.append(f"shown values differ beyond their tolerance: {found}")
        return same and not found
    return compare_outputs


def pytest_configure(config):
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:       # nbval not installed: nothing to compare
        return
    if not getattr(IPyNbCell.compare_outputs, "within_tolerance", False):
        IPyNbCell.compare_outputs = _compare_within_tolerance(IPyNbCell.compare_outputs)
        IPyNbCell.compare_outputs.within_tolerance = True
