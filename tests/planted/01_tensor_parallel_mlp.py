"""Planted wrong answer for exercises/01_tensor_parallel_mlp.ipynb (provisional, written against
the solution of 30 Nov 2026): the row-parallel layer adds its bias before the all-reduce, so the
bias is summed t times. Check 1 (the operators) still passes; Check 2 compares the MLP's output
with one device at t = 2 and 4."""

_SOLVED_COLUMN_AND_ROW = '''class ColumnLinear(nn.Module):
    "y_i = x A_i + a_i on rank i: a block of the output features of `full`."

    def __init__(self, full: nn.Linear, group: comm.Group, gather_output: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        t, i = group.size, group.rank
        self.weight = nn.Parameter(full.weight.detach().chunk(t, dim=0)[i].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(t, dim=0)[i].clone())

    def forward(self, x):
        y = F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)
        return GatherFromTP.apply(y, self.group) if self.gather_output else y


class RowLinear(nn.Module):
    "y = sum_i x_i B_i + b: rank i multiplies its block of the input features; b is added once."

    def __init__(self, full: nn.Linear, group: comm.Group):
        super().__init__()
        self.group = group
        t, i = group.size, group.rank
        self.weight = nn.Parameter(full.weight.detach().chunk(t, dim=1)[i].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        # wrong: every rank adds the bias, and the all-reduce then sums t copies of it
        return ReduceFromTP.apply(F.linear(x, self.weight, self.bias), self.group)
'''

WRONG = {"f26fbb7d": _SOLVED_COLUMN_AND_ROW}

FAILS_AT = "Check 2"
