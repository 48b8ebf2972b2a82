"""Record, or check bit for bit, the outputs of FISMO's default paths on every installed backend.

Used to prove that a refactoring changes no result: run ``--save`` on the code
before the change and ``--check`` on the code after it. Covers the core on
every available target (backend, device, dtype) with the options a
restructuring could disturb, the torch optimizer and the optax adapter.

    python docs/scripts/default_path_outputs.py --save /tmp/before.npz
    python docs/scripts/default_path_outputs.py --check /tmp/before.npz
"""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from pathlib import Path

import numpy as np

from fismo_core import FISMO
from fismo_core.testing import pin_full_float32_matmuls, reference_gradients, targets, to_numpy

STEPS = 6
CONFIGS = {
    "default": {},
    "nesterov_wd": {"nesterov": True, "weight_decay": 0.1},
    "scale_invariant": {"statistics": "scale_invariant"},
    "every3": {"inv_root": {"every": 3}},
    "ns_roots": {"inv_root": "newton_schulz"},
    "gamma1": {"gamma": 1.0},
    "skip": {"nonfinite": "skip"},
    "propagate": {"nonfinite": "propagate"},
}
SHAPES = ((12, 12), (6, 20), (20, 6), (2, 5, 9))


def _field(x):
    """A state field as a list of NumPy arrays (a blocked factor has several)."""
    if isinstance(x, tuple):
        return [to_numpy(a) for a in x if a is not None]
    return [to_numpy(x)]


def core_outputs() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for target in targets():
        if not target.available:
            continue
        for name, config in CONFIGS.items():
            opt = FISMO(**config)
            for shape in SHAPES:
                grads = reference_gradients(shape, STEPS, seed=sum(shape))
                if name == "skip":
                    grads[2] = grads[2].copy()
                    grads[2][..., 0, 0] = np.nan
                W = target.asarray(np.ones(shape) * 0.1)
                state = opt.init(W)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for G in grads:
                        W, state = opt.step(W, target.asarray(G), state)
                key = f"core/{target.id}/{name}/{'x'.join(map(str, shape))}"
                out[f"{key}/W"] = to_numpy(W)
                for field in ("P", "Q", "M", "P_inv_sqrt", "Q_inv_sqrt", "skipped", "root_failures"):
                    for i, a in enumerate(_field(getattr(state, field))):
                        out[f"{key}/{field}{i}"] = a
    return out


def torch_outputs() -> dict[str, np.ndarray]:
    try:
        import torch
        from fismo_core.backends.torch import FISMO as TorchFISMO
        from fismo_core.backends.torch import param_groups
    except ImportError:
        return {}
    out = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 8), torch.nn.ReLU(),
            torch.nn.Linear(8, 8), torch.nn.Linear(8, 3),
        ).to(dtype)
        # The split of the adapter before the output-head rule (head=None where the rule exists).
        split = {"head": None} if "head" in inspect.signature(param_groups).parameters else {}
        opt = TorchFISMO(param_groups(model, **split), lr=0.02)
        x = torch.randn(16, 2, 6, 6, dtype=dtype)
        for _ in range(STEPS):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for name, p in model.named_parameters():
            out[f"torch/{dtype}/{name}"] = p.detach().double().numpy()
    return out


def optax_outputs() -> dict[str, np.ndarray]:
    try:
        import jax
        import jax.numpy as jnp
        import optax
        from fismo_core.backends.optax import fismo
    except ImportError:
        return {}
    params = {"w": jnp.ones((6, 10)) * 0.1, "b": jnp.zeros((10,))}
    tx = fismo(0.02)
    state = tx.init(params)
    grads = reference_gradients((6, 10), STEPS, seed=3)
    update = jax.jit(tx.update)
    for G in grads:
        g = {"w": jnp.asarray(G, dtype=jnp.float32), "b": jnp.asarray(G[0], dtype=jnp.float32)}
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return {f"optax/{k}": np.asarray(v, dtype=np.float64) for k, v in params.items()}


def _npz(text: str) -> Path:
    """``text`` with NumPy's ``.npz`` suffix, which ``np.savez_compressed`` adds to a name without it: ``--save
    before`` wrote ``before.npz`` while saying ``before``, and ``--check before`` then failed after the work."""
    return Path(text if text.endswith(".npz") else text + ".npz")


def npz_to_write(text: str) -> Path:
    """``--save``: a file that may not exist yet (`_arguments.output_file`), with the ``.npz`` suffix."""
    from _arguments import output_file  # docs/scripts/, on sys.path when the script runs

    return output_file(str(_npz(text)))


def npz_to_read(text: str) -> Path:
    """``--check``: an existing file, with the ``.npz`` suffix; refused before the outputs are computed (50 s)."""
    path = _npz(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path} does not exist (write it with --save first)")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", metavar="PATH", type=npz_to_write, help="write the outputs (.npz added if missing)")
    group.add_argument("--check", metavar="PATH", type=npz_to_read, help="compare with a --save (.npz added if missing)")
    args = parser.parse_args()
    pin_full_float32_matmuls()
    outputs = {**core_outputs(), **torch_outputs(), **optax_outputs()}
    if args.save:
        np.savez_compressed(args.save, **outputs)  # args.save ends in .npz: NumPy writes that very name
        print(f"saved {len(outputs)} arrays to {args.save}")
        return 0
    saved = np.load(args.check)
    missing = sorted(set(saved.files) - set(outputs))
    differ = [k for k in saved.files if k in outputs and not np.array_equal(saved[k], outputs[k], equal_nan=True)]
    for k in missing:
        print(f"MISSING {k}")
    for k in differ:
        print(f"DIFFERS {k}: max |diff| {np.nanmax(np.abs(saved[k] - outputs[k])):.3g}")
    print(f"{len(saved.files) - len(missing) - len(differ)} of {len(saved.files)} arrays identical bit for bit")
    return 1 if missing or differ else 0


if __name__ == "__main__":
    sys.exit(main())
