"""Every ```` ```python ```` block of the README and the docs pages runs as written.

A page's blocks run in order in one fresh Python process, as a reader who
pastes them into one session would, in a temporary directory. What a page
takes for granted ("your model", "your data loader", a ``torch.distributed``
process group) is made by `READER_HAS` just before the block that needs it,
small and on the CPU. Blocks that need what a CPU machine lacks, or that
describe hours of work, are listed in `NOT_RUN` with the reason and the test
that runs the same calls; a listed block is left out of the session, so a
later block must not depend on it. A key of either table that matches no
block, or more than one, fails: a table cannot go stale unnoticed.

A block that raises fails the test with the traceback's line numbers those
of the page (each block is compiled at its own line), so the message points
at the sentence to fix. What a block prints is not compared here: the pages
that quote an output name the command, and the tests of those numbers live
with the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
# A fence at any indent (in a list item or an admonition): its code is dedented by the fence's indent.
FENCE = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.S | re.M)

# A small language-model-shaped torch model: blocks of attention and MLP matrices in `layers`,
# an output head, and a `decoder.out_proj` for the page's "another head" example.
_TORCH_MODEL = """
import torch

class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attention = torch.nn.Linear(d, 3 * d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.attention(self.norm(x)).chunk(3, dim=-1)
        return x + self.mlp(v * torch.sigmoid(q * k))

class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([_Block(d), _Block(d)])
        self.decoder = torch.nn.Module()
        self.decoder.out_proj = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.decoder.out_proj(x))

torch.manual_seed(0)
model = _TinyLM()
matrices = [p for name, p in model.named_parameters() if p.ndim == 2 and not name.startswith(("embed", "head"))]
"""

# A file store in the page's own folder (a tmp_path): a free port picked and closed before TCPStore bound it
# could be taken by another process in between (the suite runs files in parallel).
_ONE_RANK_GLOO = """
import os
import torch.distributed
torch.distributed.init_process_group("gloo", init_method="file://" + os.path.abspath("gloo-store"), rank=0,
                                     world_size=1)
"""

# (page, a line of the block) -> code run just before that block: what the page assumes the reader has.
READER_HAS: dict[tuple[str, str], str] = {
    ("README.md", "opt = FISMO.training(matrices"): _TORCH_MODEL,
    ("docs/torch.md", "for x, y in loader:"): (
        "import torch\n"
        "loader = [(torch.randn(4, 64), torch.randint(0, 10, (4,))) for _ in range(3)]\n"
    ),
    ("docs/torch.md", "# was: opt = torch.optim.Muon(matrices, lr=0.02)"): _TORCH_MODEL,
    ("docs/torch.md", '{"params": hidden_matrices}'): (
        "hidden_matrices = [p for layer in model.layers for p in layer.parameters() if p.ndim == 2]\n"
        "vectors_and_embeddings = [p for p in model.parameters() if p.ndim < 2] + [model.embed.weight]\n"
    ),
    ("docs/torch.md", '{"params": mlp_weights, "block_size": 1024}'): (
        "mlp_weights = [p for layer in model.layers for p in layer.mlp.parameters() if p.ndim == 2]\n"
        "attention_weights = [layer.attention.weight for layer in model.layers]\n"
        "vectors = [p for p in model.parameters() if p.ndim < 2]\n"
    ),
    ("docs/torch.md", "ddp_model = torch.nn.parallel.DistributedDataParallel(model)"): _ONE_RANK_GLOO,
    # Traced as written (fullgraph), run by dynamo's eager backend: inductor took a minute of CI's two cores here.
    ("docs/torch.md", "beta.fill_(min(0.95, 0.85 + 0.1 * t / 300))"): (
        _TORCH_MODEL + "from fismo_core.backends.torch import FISMO, param_groups\n"
        "import functools\n"
        "torch.compile = functools.partial(torch.compile, backend='eager')\n"
        "tokens, steps = torch.randint(0, 16, (2, 5)), 3\n"
    ),
    ("docs/torch.md", "dcp.save("): "path = \"checkpoint\"  # in the session's temporary directory\n",
    ("docs/scaling.md", "opt = FISMO(param_groups(model), lr=0.02, block_size=768)"): _TORCH_MODEL,
    ("docs/guarantees.md", 'np.savez("opt.npz"'): (
        "import numpy as np\n"
        "from fismo_core import FISMO, FISMOState\n"
        "opt = FISMO(lr=0.02)\n"
        "W = np.random.default_rng(0).standard_normal((8, 4))\n"
        "state = opt.init(W)\n"
        "W, state = opt.step(W, W - 1.0, state)\n"
    ),
    ("docs/backends.md", "tx = fismo(learning_rate=optax.cosine_decay_schedule(0.02, 10_000)"): (
        "import jax, jax.numpy as jnp\n"
        "params = {'w': jnp.ones((8, 4)) / 4, 'b': jnp.zeros((4,))}\n"
        "batch = (jnp.linspace(-1.0, 1.0, 32).reshape(4, 8), jnp.ones((4, 4)))\n"
        "def loss(params, batch):\n"
        "    x, y = batch\n"
        "    return jnp.mean((x @ params['w'] + params['b'] - y) ** 2)\n"
    ),
}

# (page, a line of the block) -> why the block is not run here, and which test runs its calls.
NOT_RUN: dict[tuple[str, str], str] = {
    ("docs/torch.md", "trainer.train()"): (
        "a 10,000-step Trainer run; tests/test_transformers.py runs the same recipe for 6 steps and resumes it"
    ),
    ("docs/backends.md", "import cupy as cp"): "CuPy on GPUs 0 and 1; tests/test_cupy.py runs these calls where CuPy is",
    ("docs/backends.md", "A = X @ X.T + 1e-3 * cp.eye(X.shape[0])"): (
        "CuPy arrays; tests/test_cupy.py and tests/test_linalg.py run these functions on every backend"
    ),
    # The measurement scripts the pages quote tables from, each given as a file to save and run.
    ("docs/linalg.md", '"""The exact polar factor on rank-deficient input'): (
        "15 minutes of measurement; tests/test_exact_unique.py checks the exact polar factor's rank cut"
    ),
    ("docs/linalg.md", '"""Newton-Schulz on exactly rank-deficient input'): (
        "26 s of measurement; tests/test_linalg.py::test_newton_schulz_band checks the iteration's band"
    ),
    ("docs/linalg.md", '"""bfloat16 Newton-Schulz iteration of polar()'): (
        "3 minutes of timing; tests/test_linalg.py::test_polar_bfloat16_iteration checks its accuracy"
    ),
}


def _blocks_of(text: str) -> list[tuple[int, str]]:
    """The ```` ```python ```` blocks of a Markdown text: (line of the block's first line of code, code)."""
    return [(text.count("\n", 0, m.start(2)) + 1, textwrap.dedent(m.group(2))) for m in FENCE.finditer(text)]


def _blocks(page: str) -> list[tuple[int, str]]:
    return _blocks_of((ROOT / page).read_text())


def _script(steps: list[tuple[str, int, str]]) -> str:
    """A script that runs each ``(filename, line, code)`` in one namespace, compiled at that file and line."""
    return textwrap.dedent(
        f"""
        steps = {steps!r}
        for filename, line_no, code in steps:
            exec(compile("\\n" * (line_no - 1) + code, filename, "exec"), globals())
        """
    )


def _matching(page: str, table: dict[tuple[str, str], str]) -> dict[str, tuple[int, str]]:
    """The one block of ``page`` each of ``table``'s keys names, by its line."""
    found = {}
    for (key_page, line), value in table.items():
        if key_page != page:
            continue
        hits = [line_no for line_no, code in _blocks(page) if line in code]
        assert len(hits) == 1, f"{page}: {line!r} must name exactly one block, names {len(hits)} (lines {hits})"
        found[line] = (hits[0], value)
    return found


def _session(page: str) -> str:
    """The page's runnable blocks as one script, each compiled at its own line of the page."""
    setups = {at: code for at, code in _matching(page, READER_HAS).values()}
    left_out = {at for at, _ in _matching(page, NOT_RUN).values()}
    steps = []
    for line_no, code in _blocks(page):
        if line_no in left_out:
            continue
        if line_no in setups:
            steps.append((f"<what {page} assumes before line {line_no}>", 0, setups[line_no]))
        steps.append((page, line_no, code))
    return _script(steps)


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # docs/backends.md lays parameters out on a 4 x 2 mesh of XLA host devices.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    return env


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)])
def test_the_pages_python_blocks_run_in_order(page: str, tmp_path: Path) -> None:
    for module in ("torch", "jax", "optax"):
        if module in "".join(code for _, code in _blocks(page)):
            pytest.importorskip(module, reason=f"{page} uses {module} (CI installs it: pip install -e '.[all]')")
    run = subprocess.run(
        [sys.executable, "-c", _session(page)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"a block of {page} fails:\n{run.stderr[-4000:]}"


def test_each_table_key_names_one_block() -> None:
    for table in (READER_HAS, NOT_RUN):
        for page in {p for p, _ in table}:
            assert page in PAGES, f"{page} is not a page"
            _matching(page, table)


def test_a_block_that_raises_fails_with_the_pages_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Intro.\n\n```python\nx = 1\n```\n\nText.\n\n```python\ny = x +\n```\n")
    blocks = _blocks_of(page.read_text())
    assert blocks == [(4, "x = 1\n"), (10, "y = x +\n")]
    script = _script([(str(page), line, code) for line, code in blocks])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert f'File "{page}", line 10' in run.stderr
