"""jaxlens's matrix exponential of rotation generators (Taylor, scaled and squared) against
SciPy's Padé one: values, and reverse-mode gradients against SciPy's Fréchet derivative,
across the squaring counts."""

import numpy as np
import scipy.linalg

import jax
import jax.numpy as jnp

from jaxlens._src.expm import expm


def test_expm_equals_scipy_with_its_gradient_and_nan_past_its_squarings():
  rng = np.random.default_rng(0)
  scales = [0.0, 1e-3, 0.3, 2.0, 40.0, 1e7]  # 0 to 9 squarings, and past the 20 allowed
  t = np.tril(rng.normal(size=(len(scales), 6, 6))) * np.array(scales)[:, None, None]
  diag = rng.normal(size=(len(scales), 6))[..., None] * np.eye(6) * 0.1
  a = t - np.swapaxes(t, 1, 2) + diag  # skew-symmetric, plus a small diagonal
  g = rng.normal(size=(6, 6))

  @jax.jit
  def run(a):
    grad = jax.grad(lambda a: jnp.sum(expm(a) * g))
    return jax.vmap(lambda a: (expm(a), grad(a)))(a), jax.vmap(expm)(a.astype(jnp.float32))

  (ours, ours_grad), ours32 = run(jnp.asarray(a))
  assert ours32.dtype == jnp.float32
  assert bool(jnp.isnan(ours[-1]).all()) and bool(jnp.isnan(ours32[-1]).all())
  for i, scale in enumerate(scales[:-1]):
    ref = scipy.linalg.expm(a[i])
    big = np.abs(ref).max()
    np.testing.assert_allclose(ours[i], ref, rtol=1e-12, atol=1e-14 * big, err_msg=str(scale))
    np.testing.assert_allclose(ours32[i], ref, rtol=1e-4, atol=2e-5 * big, err_msg=str(scale))
    # The gradient of sum(expm(a) * g) is the Fréchet derivative at aᵀ in the direction g.
    ref_grad = scipy.linalg.expm_frechet(a[i].T, g, compute_expm=False)
    big = np.abs(ref_grad).max()
    assert big > 0
    np.testing.assert_allclose(ours_grad[i], ref_grad, rtol=1e-11, atol=1e-13 * big)
