"""The check-cell API (minitron/grade/values.py) and the judge's equality (minitron/grade/judge.py)."""
from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from minitron.grade.judge import Shown, compare
from minitron.grade.values import encode, readable, show


def test_values_become_plain_json():
    assert encode(Fraction(9, 2)) == 4.5 and encode(np.float32(0.5)) == 0.5 and encode(torch.tensor(3)) == 3
    assert encode(torch.tensor([[1, 2]])) == {"shape": [1, 2], "data": [[1, 2]]}
    assert encode((True, None, "x", [np.int64(2)])) == [True, None, "x", [2]]
    json.dumps(encode({"a": torch.ones(2)}))
    with pytest.raises(TypeError, match="not a value the grader can compare"):
        encode(object())


def test_show_prints_a_rounded_line_outside_a_kernel(capsys):
    show("bubble", Fraction(3, 19))
    show("seconds", 1 / 3)
    assert capsys.readouterr().out == "bubble: 3/19\nseconds: 0.333333\n"
    assert readable(torch.tensor([0.5, 2.0])) == "[0.5, 2]"


def _shown(*pairs, rtol=1e-5):
    return [Shown(label, encode(v), rtol) for label, v in pairs]


@pytest.mark.parametrize("mine, ref", [
    (torch.histc(torch.tensor([0., 1, 1, 2]), bins=3, min=0, max=2), torch.tensor([1, 2, 1])),  # floats for ints
    (0, 0.0), (Fraction(9, 2), 4.5), ([1.0, 2.0], torch.tensor([1, 2])), (True, 1), (float("nan"), float("nan")),
    (1 + 1e-7, 1.0),
])
def test_equal_values_of_any_type(mine, ref):
    assert compare(_shown(("v", mine)), _shown(("v", ref))) is None


@pytest.mark.parametrize("mine, ref, said", [
    ([1, 2, 4], [1, 2, 3], "v: element [2] is 4, the reference 3"),
    ("0 s", 0.0, "v: yours is '0 s', the reference 0"),
    (torch.zeros(2, 3), torch.zeros(3, 2), "v: yours has shape [2, 3], the reference [3, 2]"),
    (1.001, 1.0, "v: yours is 1.001, the reference 1"),
    (float("inf"), 1.0, "v: yours is inf, the reference 1"),
])
def test_different_values_are_said(mine, ref, said):
    assert compare(_shown(("v", mine)), _shown(("v", ref))) == said


def test_missing_extra_and_relabelled_values_fail():
    ref = _shown(("a", 1), ("b", 2))
    assert "showed 1 of its 2 values" in compare(_shown(("a", 1)), ref)
    assert "labelled 'c'" in compare(_shown(("a", 1), ("c", 2)), ref)
    assert "showed 3 values" in compare(_shown(("a", 1), ("b", 2), ("b", 2)), ref)


def test_only_the_references_tolerance_counts():
    loose_mine = [Shown("v", 1.5, rtol=1.0, atol=1.0)]
    assert compare(loose_mine, [Shown("v", 1.0)]) is not None
    assert compare([Shown("v", 1.5)], [Shown("v", 1.0, rtol=0.5)]) is None


def test_only_plain_data_is_read():
    assert Shown.from_data(json.loads('{"label": "a", "value": [1, {"x": null}], "rtol": 0}')).value == [1, {"x": None}]
    for bad in ({"label": 1, "value": 2}, {"label": "a"}, {"label": "a", "value": 1, "rtol": "0"},
                {"label": "a", "value": object()}):
        with pytest.raises(ValueError):
            Shown.from_data(bad)


def test_a_bound_is_the_references():
    ref = [Shown("largest", 4000, below=9600)]
    assert compare([Shown("largest", 9000)], ref) is None
    assert compare([Shown("largest", 9600)], ref) == "largest: yours is 9600, not below 9600"
    assert compare([Shown("largest", 1, below=1e9)], [Shown("largest", 4000)]) is not None  # the learner's bound: none


def test_projections_move_with_any_element():
    from minitron.grade.values import projections
    t = torch.randn(37, 97)
    p, q = projections(t), projections(t.clone().index_put_((torch.tensor([5]), torch.tensor([3])), torch.tensor(9.0)))
    assert len(p) == 8 and projections(t) == p and p != q
