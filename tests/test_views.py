"""jaxlens.views: treescope views of traces, specs, edits and selectors; the HTML page in Chromium."""

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import jaxlens as jl
from jaxlens import intervention as ji

treescope = pytest.importorskip("treescope")
from jaxlens import views
from jaxlens.models import init_gpt


@pytest.fixture(scope="module")
def traces():
  model, v, tokens = init_gpt(
    0, n_layers=2, d_model=16, n_heads=2, max_len=6, vocab_size=11, batch=2
  )
  live = jl.when(jl.module("block_1/mlp"), ji.keep_grad(jl.scale(0.5)))
  # Jitted: one compile each, faster than running every op eagerly.
  t = jax.jit(lambda v, x: jl.trace(model, v, x, intervene=live))(v, tokens)
  replayed = jax.jit(lambda t: t.fork().do(jl.module("block_0/attn"), jl.zero_ablate()))(t)
  return t, replayed


def _sites(mv, out=None):
  out = {} if out is None else out
  for s in ([mv.out] if mv.out is not None else []) + list(mv.ops):
    out[s.label] = s
  for c in mv.children.values():
    _sites(c, out)
  return out


def test_trace_view_marks_edits_and_the_replayed_cone(traces):
  _, replayed = traces
  tv = views.view(replayed)
  sites = _sites(tv.sites)
  assert sites["block_1/mlp"].state == "keep" and sites["block_0/attn"].state == "cut"
  assert sites["block_0/attn"].edits[0].name == "zero_ablate"
  # Downstream of block_0/attn (a replay recomputes these); upstream and beside it, nothing.
  assert {"block_0", "block_0/ln_2", "block_1/attn", "ln_f", "head"} <= {
    k for k, s in sites.items() if s.state == "downstream"
  }
  assert sites["embed"].state == sites["block_0/attn/query"].state == ""
  assert tv.sites.children["block_0"].children["attn"].module_type == "CausalSelfAttention"
  assert tv.counts["edited"] == 2 and tv.counts["saved"] == len(replayed.values)
  assert [r.fired_at for r in tv.spec.rules] == [("block_1/mlp",), ("block_0/attn",)]


def test_treescope_renders_traces_specs_edits_and_selectors(traces):
  _, replayed = traces
  text = treescope.render_to_text(replayed)
  assert text.startswith("jl.Trace(")
  assert "block_0/attn: CausalSelfAttention {" in text
  assert re.search(r"edited, cuts the gradient; by jl\.zero_ablate\(\)", text)
  assert "keep_grad(jl.scale(factor=0.5))" in text and "# fired at block_0/attn" in text
  assert "float32(2, 6, 16)" in text  # shapes and dtypes, from treescope's array summary
  spec = jl.when(jl.module("embed"), ji.compose(jl.scale(2.0), jl.zero_ablate()))
  text = treescope.render_to_text(spec)
  assert "jl.compose(" in text and "# cuts the gradient" in text and "# 1 rules" in text
  assert (
    treescope.render_to_text(jl.module("block_*") | jl.func("tanh"))
    == "(jl.module('block_*') | jl.func('tanh'))"
  )
  matched = treescope.render_to_text(views.view(jl.module("block_*/mlp"), trace=replayed))
  assert matched == "jl.module('block_*/mlp')  # matches block_0/mlp, block_1/mlp"
  fired = treescope.render_to_text(views.view(jl.when("ln_f", jl.scale(2.0)), trace=replayed))
  assert "# fired at ln_f" in fired
  steer = treescope.render_to_text(ji.keep_grad(jl.steer(jnp.ones(3), 2.0)))
  assert steer.startswith("jl.keep_grad(jl.steer(") and "keep_grad: checked when it fires" in steer
  differentiable = replayed.do(
    jl.module("block_1"), jl.scale(1.0), intervention=jl.InterventionOptions(differentiable=True)
  )
  assert "frontier={" in treescope.render_to_text(differentiable)


def test_repr_of_a_trace_whose_model_returns_a_pytree():
  import flax.linen as nn

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(3, name="dense", param_dtype=jnp.float64)(x)
      return {"h": h, "y": (h.sum(-1), x)}

  class Pair(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(3, name="dense", param_dtype=jnp.float64)(x)
      return h, h.sum(-1)

  x = jnp.ones((2, 4))
  t = jl.trace(Two(), Two().init(jax.random.key(0), x), x)
  assert repr(t) == ("Trace(output={'h': (2, 3), 'y': ((2,), (2, 4))}, sites={'dense': (2, 3)})")
  assert "dense: Dense {" in treescope.render_to_text(t)
  pair = jl.trace(Pair(), Pair().init(jax.random.key(0), x), x)  # np.shape of it raised
  assert repr(pair).startswith("Trace(output=((2, 3), (2,)), ")
  # The classes define their views: treescope finds them with nothing registered.
  registry = treescope.type_registries.TREESCOPE_HANDLER_REGISTRY
  assert not [k for k in registry if k.__module__.startswith("jaxlens")]
  for cls in (jl.Trace, jl.Spec, jl.Edit, jl.Site):
    assert "__treescope_repr__" in vars(cls), cls
  assert treescope.render_to_text(jl.scale(0.5)).endswith("# keeps the gradient")
  assert t.to_html().startswith("<!doctype html>")


# Copies the text treescope rendered (inside its shadow DOM) into the page, for --dump-dom.
_PROBE = """<script>
function probe() {
  const c = document.querySelector("treescope-container");
  const root = c && c.shadowRoot && c.shadowRoot.querySelector(".treescope_root");
  if (root && root.innerText.length > 100) {
    const out = document.createElement("pre"); out.id = "rendered"; out.textContent = root.innerText;
    document.body.appendChild(out);
  } else { setTimeout(probe, 50); }
}
setTimeout(probe, 50);
</script></body>"""


def _chromium():
  return (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
  )


@pytest.mark.skipif(_chromium() is None, reason="no Chromium on this machine")
def test_html_page_renders_in_headless_chromium(traces, tmp_path):
  _, replayed = traces
  page = views.to_html(replayed, tmp_path / "trace.html", title="a replayed trace")
  assert (tmp_path / "trace.html").read_text() == page
  probe = tmp_path / "probe.html"
  probe.write_text(page.replace("</body>", _PROBE))
  # Treescope renders from script after load; on a loaded machine the headless browser can
  # dump the page before that, so a dump without the rendered tree is retried with a larger
  # virtual-time budget (the page itself is the same).
  for budget in (10000, 30000, 60000):
    out = subprocess.run(
      [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / f'profile-{budget}'}",
        f"--virtual-time-budget={budget}",
        "--dump-dom",
        probe.as_uri(),
      ],
      capture_output=True,
      text=True,
      timeout=180,
      check=False,
    )
    m = re.search(r'<pre id="rendered">(.*?)</pre>', out.stdout, re.DOTALL)
    if m:
      break
  assert m, out.stdout[-2000:] + out.stderr[-2000:]
  rendered = m.group(1)
  for name in (
    "block_0/attn: CausalSelfAttention",
    "block_1/mlp: MLP",
    "embed: Embed",
    "fired at block_0/attn",
    "keep_grad(jl.scale(factor=0.5))",
  ):
    assert name in rendered, name
  assert "<title>a replayed trace</title>" in out.stdout


def test_a_live_edit_is_not_labelled_as_recomputed_by_replay(traces):
  """Issue 31: a live intervene= trace labelled its downstream sites "recomputed by replay"."""
  live, replayed = traces
  states = {k: s.state for k, s in _sites(views.view(live).sites).items()}
  assert states["block_1/mlp"] == "keep"
  assert states["ln_f"] == states["head"] == "live downstream"
  assert "downstream" not in states.values()
  assert "by a replay" not in treescope.render_to_text(live)
  assert "downstream of a live edit" in treescope.render_to_text(live)
  # The replay's own cone is "recomputed"; the live edit's rule came first (replayed_from=1).
  replayed_states = {k: s.state for k, s in _sites(views.view(replayed).sites).items()}
  assert replayed_states["block_0/ln_2"] == "downstream"
  assert "recomputed downstream of an edit by a replay" in treescope.render_to_text(replayed)
