"""numpy float32 emulation of the prefill kernels' double-float cumsum (``_ct_df_cumsum``) and decay terms
(``_ct_decay_terms``, ``ssd_cb_kernel``'s r_i * dl_j) on one chunk, with and without a floor on the log2 step
delta * A * log2(e) (``LOG2_STEP_FLOOR``, m2export/kernels/ssd/cutile.py), against float64 segment sums.

Two combine orders (sequential; Hillis-Steele, another order a ct.scan may use). Prints, per case: max |lo|, max
r_i * dl_j / delta_j (how far the residuals push the factors off 1: x * dl is cast to the input dtype, fp16 included),
rel-L2 of y = r * (M @ dl), of the cb_pre 2 form, and of w vs float64. CPU only, ~1 min:

    python benchmarks/df_cumsum_emulation.py
"""
import warnings

import numpy as np
f = np.float32
np.seterr(all="ignore")
warnings.filterwarnings("ignore")
def two_sum(a, b):
    s = f(a + b); bb = f(s - a); return s, f(f(a - f(s - bb)) + f(b - bb))
def df_add(h1, l1, h2, l2):
    s, e = two_sum(h1, h2); e = f(e + f(l1 + l2)); h = f(s + e); return h, f(e - f(h - s))
def seq_scan(v):
    hs, ls = [], []; h = f(0); l = f(0)
    for x in v:
        h, l = df_add(h, l, f(x), f(0)); hs.append(h); ls.append(l)
    return np.array(hs, f), np.array(ls, f)
def tree_scan(v):  # Hillis-Steele inclusive scan (another combine order)
    h = v.astype(f).copy(); l = np.zeros_like(h); n = len(v); d = 1
    while d < n:
        h2, l2 = h.copy(), l.copy()
        for i in range(d, n):
            h2[i], l2[i] = df_add(h[i - d], l[i - d], h[i], l[i])
        h, l, d = h2, l2, d * 2
    return h, l
LOG2E = f(1.4426950408889634)
def floor_(x, F):
    return x if F is None else np.where(x < f(F), f(F), x).astype(f)
def kernel(delta, A, F, scan):
    dA = floor_((delta * (f(A) * LOG2E)).astype(f), F)
    hi, lo = scan(dA)
    r = np.exp2(lo); dl = (delta * np.exp2(-lo)).astype(f)
    Q = len(delta); i, j = np.meshgrid(range(Q), range(Q), indexing='ij')
    Mexp = np.exp2(np.where(i >= j, (hi[:, None] - hi[None, :]).astype(f), -np.inf)).astype(f)
    y = (r * (Mexp @ dl)).astype(f)             # unscaled path: r_i * (M @ dl)
    rdl = (r[:, None] * dl[None, :]).astype(f)  # cb_pre 2: r_i*dl_j before the decay
    y2 = ((rdl * Mexp).sum(1)).astype(f)
    w = (delta * np.exp2((hi[-1] - hi) + (lo[-1] - lo))).astype(f)
    return y, y2, w, hi, lo, rdl
def exact(delta, A):
    dAn = delta.astype(np.float64) * A; Q = len(delta)
    seg = np.full((Q, Q), -np.inf)
    for a in range(Q):
        s = 0.0
        for b in range(a, -1, -1):
            seg[a, b] = s; s += dAn[b]
    i, j = np.meshgrid(range(Q), range(Q), indexing='ij')
    ye = (np.exp(seg) * (i >= j)) @ delta.astype(np.float64)
    return ye, np.exp(seg[-1]) * delta
def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b) if np.isfinite(a).all() else float('nan')
rng = np.random.default_rng(0)
cases = []
for Q in (64, 128, 256):
    d = (rng.random(Q) * 0.5 + 0.05).astype(f); d[::3] = 1e10
    cases += [(f"Q{Q} A-1e30 spikes", d, -1e30), (f"Q{Q} A-0.7 dt1e10/3", d, -0.7)]
    d = (rng.random(Q) * 0.5 + 0.05).astype(f); d[::2] = 1e10
    cases += [(f"Q{Q} A-1.3 dt1e10/2 (lo worst)", d, -1.3)]
    d = np.full(Q, 1e10, f); d[1::2] = rng.random(Q // 2).astype(f) * 1e-3  # floored + tiny residuals
    cases += [(f"Q{Q} A-3 alt 1e10/tiny", d, -3.0)]
    d = (rng.random(Q) * 5).astype(f)
    cases += [(f"Q{Q} ordinary A-16 dt<5", d, -16.0)]
for F in (None, -2.0**22, -2.0**16):
    print("floor", F)
    for name, d, A in cases:
        ye, we = exact(d, A)
        for sn, sc in (("seq", seq_scan), ("tree", tree_scan)):
            y, y2, w, hi, lo, rdl = kernel(d, A, F, sc)
            print(f"  {name:30s} {sn}: max|lo| {np.abs(lo).max():9.3g}  max r*dl/delta {np.nanmax(rdl/np.maximum(d[None,:],1e-30)):9.3g}"
                  f"  rel y {rel(y, ye):9.3g}  y(cb_pre2) {rel(y2, ye):9.3g}  w {rel(w, we):9.3g}")
# NaN dt stays NaN under the floor; -inf floors
print("floor(nan, -inf, -1e30, -5):", floor_(np.array([np.nan, -np.inf, -1e30, -5], f), -2.0**16))
