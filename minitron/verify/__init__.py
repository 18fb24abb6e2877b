"""python -m minitron.verify --tp 2 --sp [--pp 2 --schedule zb-h1]: the split model against one device.

Both models start from the same weights and the same dropout seed and see the same batches.
Every step compares, on rank 0 after gathering the shards (for the comparison only): logits,
loss, dL/dX (X = the input of the first block) and every weight gradient, each against the
float32 rounding bar of minitron.verify.checks (C * sqrt(K) * eps32 for sums of K terms).
Then both sides take one AdamW step on the same gradients, the reference's (each rank steps
its shards: AdamW is elementwise), and every tensor's update w_new - w_old is compared with
the reference's at the update's own scale. On every rank, the tensors a group holds whole
(norm weights, row-parallel biases, positions under tp) must be bitwise identical across it,
gradients and weights: the `replicas` rows, which name the tensor and ranks that differ.

Prints one row per (step, quantity) with the worst relative error and its tolerance, the
smallest margin (tolerance / error), then `PASS max_rel_err=...` (exit 0) or `FAIL ...`
(exit 1). Gradients and updates are grouped by name with the layer index replaced by `*`
(worst over the layers), covering every parameter.

AdamW's eps defaults to 1e-6 here, not torch's 1e-8: a gradient entry at the float32 noise
level (~1e-7 of its tensor's largest) counts as noise, not as a direction worth lr. (The check
no longer depends on it: both sides step on the same gradients, so `--eps 1e-8` passes too.)

`--pp`, `--virtual`, `--schedule` and `--microbatches` cut the model into pipeline stages
(model/stages.py) and run every step with the pipeline executor and the named schedule
(pipeline/schedules.py): the same rows are compared, with the logits of every micro-batch and
dL/dX collected from the stages that made them, every gradient and weight gathered across the
stages, and the tied embedding's two copies (first and last stage) bitwise equal over the
`embedding` group. The batch defaults to one sequence per micro-batch.

`--recompute full|selective` makes the split model recompute every layer, or only its
attention core, in backward (ModelConfig.recompute); the reference keeps everything.

`--kernels` builds the split model with ModelConfig(use_kernels=True), so its norms, attention,
MLP activations and loss run minitron.kernels' fused Triton kernels, and steps it with
FusedAdamW; the reference keeps plain torch ops and torch.optim.AdamW, and the tolerances stay
the same. Where the ranks run on the CPU (no GPU for each of them) it sets TRITON_INTERPRET=1
before anything imports triton, so the kernels run in Triton's interpreter (slowly), and says
so in the header.

`--dp N` runs N data-parallel replicas (composing with --tp/--sp and --pp): each takes its own
rows of the global batch (dropout masks are keyed by global row) and the engine of
minitron.data_parallel averages the gradients, in buckets started from backward hooks; with
`--zero 1|2|3` the gradients are reduce-scattered and ZeRO's ZeroOptimizer steps fp32 master
weights of each rank's shard (stage 3 also shards the weights, gathered per layer, inside
pipeline stages too: each pipeline rank shards its own stages). The logits
and dL/dX are gathered back over dp, the loss averaged over dp: the rows are the whole batch's,
compared with the reference on the whole batch. The gradients compared are the reduced ones,
rebuilt from the shards (data_parallel.checks); replicas must stay bitwise equal over dp, the
gradients under plain DP, the weights below stage 3. steps.py has the per-rank steps.

`--dtype bfloat16|float16|fp8` runs the reference in the same precision as the split, at the
same casting points: 16-bit weights and activations, fp32 master weights (the split side through
the data-parallel engine, the reference through precision.MasterWeightsAdamW), float16's loss
scaled by a fixed 1024 on both sides; under fp8 (`--fp8-recipe delayed|current`) the same FP8
GEMMs on both sides (tensor_parallel/fp8_linear.py; the reference fuses q, k, v and [gate; up]
into one GEMM and one scale each, as the split does) with the amaxes reduced over tp x cp x ep x dp,
so each cast uses the scale one device uses; under `--fp8-recipe blockwise|mxfp8` (a scale per
block, tensor_parallel/fp8_blocks.py) with blocks no split cuts (the largest power of two up to
128 or 32 dividing every rank's piece), so each block is one device's block, cast alike. A bar derived from eps16 cannot tell a 1% error
from bf16's own 0.8% rounding, so these runs are judged against the noise of their own
precision, measured each step (verify/noise.py, checks.noise_rows): six twins of the reference
(same weights, masks, FP8 histories) run with every reduction cut in two rounded parts at six
points, as a split cuts them. For every tensor (logits, loss, dL/dX, each gradient, each side
divided by its own loss scale), with e = split - reference, n_k = twin_k - reference, r = the
reference:

    norm-wise  ||e||/||r||    <= C_NORM  (6)  x RMS_k ||n_k||/||r||            (rows "grad X")
    along      |<e,r>|/<r,r>  <= C_ALONG (15) x max(S, RMS_k ||n_k||/||r|| / sqrt(n_eff))
                                                                          (rows "grad X along")

S is the twins' RMS of <n_k,r>/<r,r>, pooled over the tensors of one name (the layers of a
family); n_eff = (sum r^2)^2 / sum r^4 counts the entries that carry r (independent relative
roundings of norm-wise size f have RMS f / sqrt(n_eff) along r). Rounding noise is about as
large norm-wise in a correct split as in a twin (measured 1.0-1.8x) and mostly across the
reference; a scale error (a gradient 3.9% off) is all along it. Chosen by measurement
(tools/verdict_margins.py: tp2+SP at a small shape, seeds 0-3, every precision and plant; and
the matrix's low-precision rows): correct splits reach 1.8 units norm-wise and 3.9 along, so
the constants pass them by >= 3.4x; the plant grad (max(1%, 5 eps): 3.9% in bfloat16, 1% in
float16; plants.grad_error) fails by >= 4x. At 1% in bfloat16 it reaches only 16 units along,
where correct runs reach 3.9: 3x both ways is out of reach for a change of 1.3 bf16 spacings.
Updates are compared where they are made, at the fp32 master
weights, with the float32 update bar (rows "master X"; a 1% update error fails by 5000x), and
the 16-bit copies as before (rows "weight X"). Under fp8 a row "fp8 scales (log2)" compares
every scaler's latest scale with the reference's: |log2(ratio)| <= C_SCALE (5) x max(the
twins', 1/16) (mxfp8's power-of-two scales: the binades beyond the one a rounding can flip,
fp8_rows.amax_binades); under blockwise and mxfp8 both the largest block scale and the smallest
(the tensor's amax's, blocks of zeros left out), each against its own twins; scaling switched off, a stale amax, an amax from the wrong tensor, E5M2's scales in the
forward move scales by factors of 3 to 10^7. The loss's floor is at least the logits' (a
scalar's twins may land on it by chance). Plants: grad, update, fp16-unscaled-loss, fp8-*.

`--experts N` makes the MLP of layers 0, k, 2k, ... (`--moe-every k`) a mixture of N experts
(minitron/moe/: `--topk`, `--capacity-factor`, `--pre-softmax`, aux and z-loss coefficients),
and `--ep E` spreads each layer's experts over E ranks (tp defaults to 1 then; with --tp > 1
sequence parallelism is required). Expert-parallel ranks are data-parallel replicas of the
dense layers, so they run through the data-parallel engine on their own rows (dp x ep of
them): dense gradients averaged over dense_dp, expert gradients summed over dp_cp. The loss
includes the routers' auxiliary losses on both sides; a `moe drops` row per step checks that a
capacity factor dropped exactly the reference's (token, expert) pairs. In 16 bits a `moe routing`
row counts the (token, expert) choices that differ between the sides (a rounding flip of a top-k
is a discontinuity no tolerance covers); `--reference-routing` makes the split model take the
reference's choices, so the rest is compared at the 16-bit tolerance (routing.py).
`--balance aux-free` (DeepSeek-V3's per-expert router bias, moe/balance.py) adds an `expert
bias` row per step, after both sides' bias updates: every rank's biases against one device's,
bitwise, in units of `--bias-update-rate` (bias_rows.py). With one step an update changes no
output, so without this row a bias moved by the wrong counts would pass.

`--cp C` cuts every sequence of the batch into 2C chunks and gives cp rank r chunks r and
2C-1-r (zigzag: equal causal work, minitron/context_parallel); attention reaches the other
ranks' keys and values by `--cp-variant` (ring, allgather, ulysses). A rank's loss is the mean
over its tokens, so the loss is averaged over cp, logits and dL/dX are gathered back in token
order (dL/dX divided by C), and gradients are averaged over cp (finalize_grads; with --dp the
engine's average over dense_dp = dp x cp). With --pp every cp rank of a stage runs the schedule
on its chunks of each micro-batch, and stages exchange s/cp tokens. Not yet with --ep or 16-bit
dtypes.

run.py launches the ranks (verify()), steps.py is each rank's step of both sides, checks.py the
comparisons (tolerances.py the float32 bars, report.py the rows and verdict, float32_rows.py,
noise_rows.py, replica_rows.py and fp8_rows.py the rows of each kind), routing.py the routers' choices,
plants.py the planted bugs that show a check can fail (plants_*.py each layer's, patched in by
patching.py), compare.py the relative-error helpers the tests and lessons share, cli.py the
command line.
"""
from .checks import Report, Row
from .run import verify
from .steps import make_batch, reference_step, run_rank

__all__ = ["verify", "run_rank", "make_batch", "reference_step", "Report", "Row"]
