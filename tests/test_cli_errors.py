"""Every bad option of minitron.verify is refused before a rank starts: exit 2, one line on
stderr that names the flag and a value that works. From Python the same refusals name the field."""
import math

import pytest

from minitron import verify
from minitron.verify import cli as verify_cli
from minitron.grid import ParallelConfig
from minitron.model.splits import validate_model
from minitron.config import ConfigError, ModelConfig, check_adamw


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if anything would start a rank."""
    def launched(*args, **kwargs):
        raise AssertionError("a rank was started for options that should have been refused")
    monkeypatch.setattr(verify.run, "launch", launched)


@pytest.mark.parametrize("argv,line", [
    (["--lr", "-1"], "--lr -1 must be a finite number > 0; use --lr 0.0001"),
    (["--lr", "nan"], "--lr nan must be a finite number > 0; use --lr 0.0001"),
    (["--lr", "inf"], "--lr inf must be a finite number > 0; use --lr 0.0001"),
    (["--eps", "-1"], "--eps -1 must be a finite number > 0; use --eps 1e-08"),
    (["--eps", "0"], "--eps 0 must be a finite number > 0; use --eps 1e-08"),
    (["--ep", "2", "--experts", "4", "--capacity-factor", "inf"],
     "--capacity-factor inf: use a finite number > 0"),
    (["--vocab", "1001"], "--vocab 1001 is not divisible by --tp 2: pad it (the extra rows are never "
                          "a target); use --vocab 1002"),
    (["--seq", "0"], "--seq 0 must be a positive integer; use --seq 32"),
    (["--tp", "1", "--pp", "3", "--layers", "4"],
     "--layers 4 is not divisible by --pp 3 * --virtual 1: every pipeline chunk needs the same "
     "number of layers; use --pp 2 or --pp 4 or --layers 6"),
    (["--tp", "1", "--cp", "3"], "--seq 16 is not divisible by 2 * --cp 3: context parallelism cuts "
                                 "each sequence into 2*cp chunks to balance causal work; use --cp 2 "
                                 "or --cp 4 or --seq 18"),
    (["--ep", "3", "--experts", "4"], "; use --ep 2 or --ep 4 or --experts 6"),
    (["--heads", "5"], "--hidden 64 is not divisible by --heads 5: every head has hidden/n_heads "
                       "features; use --heads 4 or --heads 8"),
    (["--tp", "4", "--hidden", "48", "--heads", "6"], "--heads 6 is not divisible by --tp 4"),
    (["--sp", "--tp", "1"], "--sp shards the norm/dropout regions across the tensor-parallel group, "
                            "so it needs tp > 1, not --tp 1; use --tp 2 or drop --sp"),
    (["--tensor", "2"], "unrecognized arguments: --tensor 2; see python -m minitron.verify --help"),
    (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
])
def test_a_bad_option_is_one_line_naming_the_flag_and_a_value(capsys, no_ranks, argv, line):
    assert verify_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert line in err, err


def test_a_suggested_value_is_accepted(monkeypatch, capsys, no_ranks):
    """The values the refusals offer pass every check (the run is stopped at the launch)."""
    for argv in (["--vocab", "1002"], ["--tp", "1", "--pp", "2", "--layers", "4"],
                 ["--tp", "1", "--pp", "4", "--layers", "4"], ["--tp", "1", "--cp", "2"],
                 ["--tp", "1", "--cp", "4"], ["--ep", "2", "--experts", "4"], ["--heads", "8"],
                 ["--tp", "2", "--hidden", "48", "--heads", "6"], ["--seq", "32"]):
        with pytest.raises(AssertionError, match="a rank was started"):
            verify_cli.main(argv)
    capsys.readouterr()


def test_expert_parallel_dtypes(capsys, no_ranks):
    """--ep 2 runs in 16 bits (the routers' choices are counted: verify/routing.py) and refuses
    float64, naming every dtype that works."""
    assert verify_cli.main(["--ep", "2", "--experts", "4", "--dtype", "float64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dtype float64: ") and err.rstrip().endswith(
        "; use --dtype float32 or --dtype bfloat16 or --dtype float16"), err
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(AssertionError, match="a rank was started"):
            verify_cli.main(["--ep", "2", "--experts", "4", "--dtype", dtype])
    capsys.readouterr()


def test_dtype_refusals_offer_every_dtype_that_works(capsys, no_ranks):
    assert verify_cli.main(["--dp", "2", "--dtype", "float64"]) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "; use --dtype float32 or --dtype bfloat16 or --dtype float16")


@pytest.mark.parametrize("lr,eps", [(-1.0, 1e-6), (math.nan, 1e-6), (math.inf, 1e-6), (0.0, 1e-6),
                                    (1e-4, 0.0), (1e-4, -1.0), (1e-4, math.nan)])
def test_python_api_refuses_lr_and_eps_naming_the_field(no_ranks, lr, eps):
    field = "lr" if not (math.isfinite(lr) and lr > 0) else "eps"
    with pytest.raises(ConfigError, match=rf"^{field}=\S+ must be a finite number > 0; use {field}="):
        verify.verify(ParallelConfig(tp=1), ModelConfig(), steps=1, lr=lr, eps=eps)
    check_adamw(1e-4, 1e-8)           # and a good pair passes


def test_python_errors_name_fields_not_flags():
    with pytest.raises(ConfigError) as e:
        validate_model(ParallelConfig(tp=2), ModelConfig(vocab_size=1001))
    assert str(e.value) == ("vocab_size=1001 is not divisible by tp=2: pad it (the extra rows are "
                            "never a target) (minitron.grid.pad_vocab_size); use vocab_size=1002")
    with pytest.raises(ConfigError, match=r"capacity_factor=inf: .*; use capacity_factor=1.0 or "
                                          r"capacity_factor=None"):
        ModelConfig(n_experts=4, capacity_factor=math.inf)
    with pytest.raises(ConfigError, match=r"aux_loss_coeff=nan must be a finite number >= 0"):
        ModelConfig(n_experts=4, aux_loss_coeff=math.nan)


def test_the_kernels_dtype_refusal_still_names_float32(capsys, no_ranks):
    assert verify_cli.main(["--kernels", "--dtype", "bfloat16"]) == 2
    assert "use --dtype float32" in capsys.readouterr().err


def test_a_config_error_survives_pickling():
    """A rank may send one back to the launcher: it must arrive whole, fixes included."""
    import pickle
    with pytest.raises(ConfigError) as e:
        validate_model(ParallelConfig(pp=3), ModelConfig(n_layers=4))
    back = pickle.loads(pickle.dumps(e.value))
    assert str(back) == str(e.value) and back.as_flags({"pp": "--pp"}) == e.value.as_flags({"pp": "--pp"})
