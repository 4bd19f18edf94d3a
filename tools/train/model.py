"""The qwen35 hybrid target in plain PyTorch, ternary-aware, in the prism-rotated basis.

Exactly the math of src/models/qwen35.cpp (SPEC 2.4 + 3), written in HF's grouped V-head order
(GDN V head p reads K head p // (Hv/Hk)); export_target.py reorders to the GGUF's tiled order.

Every matmul except ssm_alpha/ssm_beta is   y = T(W) . H_blk(s_w (.) x)
  T(W): per 128 inputs, d = max|w| (fp16-rounded), q = round-half-away(w/d) in {-1,0,1}, T = q*d
        (SPEC 1.1's PTQ1_0/PQ2_0 reference quantizer), straight-through gradient;
  H_blk: normalized Sylvester Hadamard per `prism_block` chunk; s_w: the +-1 sign vector of width w.
Embedding (inverse list):  e = s_E (.) H_blk(T(E)[id]).    ssm_alpha/beta: bf16-rounded, plain input.
Norm weights are stored as the multiplier itself (llama.cpp's 1+w; ssm_norm plain).
"""
import math
from dataclasses import dataclass, asdict, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TargetConfig:
    n_vocab: int = 12288
    n_embd: int = 512
    n_layer: int = 8
    n_ff: int = 1536
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 128
    n_rot: int = 32
    rope_theta: float = 1e7
    full_attn_interval: int = 4
    conv_kernel: int = 4
    ssm_k_heads: int = 4
    ssm_v_heads: int = 8
    ssm_head_k: int = 64
    ssm_head_v: int = 64
    rms_eps: float = 1e-6
    prism_block: int = 512
    ternary: bool = True
    seed: int = 1234
    n_ctx_train: int = 4096

    def is_attention(self, il):
        return (il + 1) % self.full_attn_interval == 0

    @property
    def inner(self):
        return self.ssm_v_heads * self.ssm_head_v

    @property
    def conv_dim(self):
        return 2 * self.ssm_k_heads * self.ssm_head_k + self.inner

    @property
    def q_width(self):
        return self.n_head * self.head_dim

    def widths(self):
        """Distinct rotated input widths, in the order synth.cpp writes prism.hadamard.sign_widths."""
        out = [self.n_embd]
        for w in (self.inner, self.q_width, self.n_ff):
            if w not in out:
                out.append(w)
        return out


def hadamard_matrix(n):
    idx = torch.arange(n)
    pc = torch.zeros(n, n, dtype=torch.int64)
    a = idx[:, None] & idx[None, :]
    for b in range(int(math.log2(n)) + 1):
        pc += (a >> b) & 1
    return (1 - 2 * (pc % 2)).to(torch.float32) / math.sqrt(n)


def ternarize(w, enabled=True):
    """T(W) on [out, in] fp32 with a straight-through gradient."""
    if not enabled:
        return w
    out, n = w.shape
    wb = w.reshape(out, n // 128, 128)
    d = wb.detach().abs().amax(-1, keepdim=True)
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    x = wb.detach() * inv
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    q = q.clamp(-1, 1)
    d16 = d.to(torch.float16).to(torch.float32)
    wq = (q * d16).reshape(out, n)
    return w + (wq - w).detach()


def ternary_codes(w):
    """The codes and scales ternarize() uses (for export): q int8 [out, in], d fp16 [out, in/128]."""
    out, n = w.shape
    wb = w.detach().float().reshape(out, n // 128, 128)
    d = wb.abs().amax(-1, keepdim=True)
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    x = wb * inv
    q = (torch.sign(x) * torch.floor(x.abs() + 0.5)).clamp(-1, 1)
    return q.reshape(out, n).to(torch.int8), d.reshape(out, n // 128).to(torch.float16)


def bf16_ste(w):
    return w + (w.to(torch.bfloat16).to(torch.float32) - w).detach()


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * w


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def rope_neox(x, pos, n_rot, theta):
    """x [..., T, heads, hd] with pos [T] (or broadcastable [B, T]); rotate the first n_rot dims."""
    half = n_rot // 2
    inv = theta ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) * 2.0 / n_rot)
    ang = pos.to(torch.float32)[..., None] * inv  # [..., T, half]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]  # [..., T, 1, half]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    xf1, xf2 = x1.float(), x2.float()
    o1 = xf1 * cos - xf2 * sin
    o2 = xf2 * cos + xf1 * sin
    return torch.cat([o1.to(x.dtype), o2.to(x.dtype), rest], -1)


def attention(q, k, v, mask=None, causal=False):
    """q [B,H,Tq,d], k/v [B,H,Tk,d]; mask: bool [.., Tq, Tk] True = visible."""
    if hasattr(F, "scaled_dot_product_attention"):
        if causal and mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal and mask is None:
        Tq, Tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype)


# ------------------------------------------------------------------------------------------------
# Gated delta rule

def gdn_recurrent(q, k, v, g, beta, S):
    """q,k [B,H,T,dk] (normed, q scaled), v [B,H,T,dv], g/beta [B,H,T]; S [B,H,dk,dv] fp32."""
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        kv = (S * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - kv) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, 2), S


def gdn_chunked(q, k, v, g, beta, S, chunk=64):
    """Same as gdn_recurrent in WY/UT chunked form (fp32)."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    vb = v * beta[..., None]
    kb = k * beta[..., None]
    gc = g.cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf"))
    decay = diff.exp()  # [B,H,N,C,C], lower incl. diagonal
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    L = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower: beta_i k_i.k_j exp(G_i - G_j)
    A = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    value = A @ vb
    kcum = A @ (kb * gc.exp()[..., None])
    outs = []
    for n in range(N):
        qn, kn = q[:, :, n], k[:, :, n]
        att = (qn @ kn.transpose(-1, -2)) * decay[:, :, n]
        vnew = value[:, :, n] - kcum[:, :, n] @ S
        o = (qn * gc[:, :, n].exp()[..., None]) @ S + att @ vnew
        outs.append(o)
        glast = gc[:, :, n, -1]
        S = S * glast.exp()[..., None, None] + (kn * (glast[..., None] - gc[:, :, n]).exp()[..., None]).transpose(-1, -2) @ vnew
    o = torch.stack(outs, 2).reshape(B, H, N * C, dv)[:, :, :T]
    return o, S


# ------------------------------------------------------------------------------------------------

class Target(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg
        gen = torch.Generator().manual_seed(c.seed)
        self.register_buffer("hmat", hadamard_matrix(c.prism_block), persistent=False)
        for w in c.widths():
            assert w % c.prism_block == 0 and w % 128 == 0, f"width {w} must be a multiple of the block"
            s = (torch.randint(0, 2, (w,), generator=gen) * 2 - 1).to(torch.float32)
            self.register_buffer(f"signs_{w}", s)
        std = 0.02
        out_std = 0.02 / math.sqrt(2 * c.n_layer)

        def P(*shape, s=std):
            return nn.Parameter(torch.randn(*shape, generator=gen) * s)

        def ones(n):
            return nn.Parameter(torch.ones(n))

        E = c.n_embd
        self.tok_embd = P(c.n_vocab, E)
        self.output = P(c.n_vocab, E)
        self.output_norm = ones(E)
        self.layers = nn.ModuleList()
        for il in range(c.n_layer):
            L = nn.Module()
            L.attn_norm = ones(E)
            L.post_attn_norm = ones(E)
            if c.is_attention(il):
                L.wq = P(2 * c.q_width, E)
                L.wk = P(c.n_head_kv * c.head_dim, E)
                L.wv = P(c.n_head_kv * c.head_dim, E)
                L.wo = P(E, c.q_width, s=out_std)
                L.q_norm = ones(c.head_dim)
                L.k_norm = ones(c.head_dim)
            else:
                L.w_qkv = P(c.conv_dim, E)
                L.w_gate = P(c.inner, E)
                L.w_alpha = P(c.ssm_v_heads, E)
                L.w_beta = P(c.ssm_v_heads, E)
                L.w_out = P(E, c.inner, s=out_std)
                L.conv1d = nn.Parameter(torch.randn(c.conv_dim, c.conv_kernel, generator=gen) / math.sqrt(c.conv_kernel))
                L.dt_bias = nn.Parameter(torch.ones(c.ssm_v_heads))
                L.A_log = nn.Parameter(torch.log(torch.empty(c.ssm_v_heads).uniform_(1, 16, generator=gen)))
                L.ssm_norm = ones(c.ssm_head_v)
            L.ffn_gate = P(c.n_ff, E)
            L.ffn_up = P(c.n_ff, E)
            L.ffn_down = P(E, c.n_ff, s=out_std)
            self.layers.append(L)

    # ---- prism: effective weights W_eff = (T(W) @ H_blk) * s, so  x @ W_eff^T == T(W) . H_blk(s (.) x)
    def _eff(self, w, rotate=True):
        cache = getattr(self, "_cache", None)
        if cache is not None and id(w) in cache:
            return cache[id(w)]
        with torch.autocast(device_type=w.device.type, enabled=False):  # effective weights in fp32
            t = self.T(w.float())
            if rotate:
                n = t.shape[1]
                blk = self.cfg.prism_block
                t = (t.reshape(t.shape[0], n // blk, blk) @ self.hmat).reshape(t.shape) * getattr(self, f"signs_{n}")
        if cache is not None:
            cache[id(w)] = t
        return t

    def freeze(self, on=True):
        """Inference: compute every effective weight once and reuse it (no gradients)."""
        self._cache = {} if on else None

    def T(self, w):
        return ternarize(w, self.cfg.ternary)

    def embed(self, ids):
        """e = s (.) H_blk(T(E)[id]): with H symmetric, the rows of (T(E) @ H_blk) * s."""
        return F.embedding(ids, self._eff(self.tok_embd))

    def lm_head(self, h):
        """h: the final-normed hidden state (or a drafter's output) -> logits."""
        return F.linear(h, self._eff(self.output).to(h.dtype))

    # ---- blocks
    def _lin(self, x, w):
        return F.linear(x, self._eff(w).to(x.dtype))

    def attn_block(self, L, n, pos, st):
        c = self.cfg
        B, T, _ = n.shape
        xr = n
        qg = self._lin(xr, L.wq).reshape(B, T, c.n_head, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:]
        k = self._lin(xr, L.wk).reshape(B, T, c.n_head_kv, c.head_dim)
        v = self._lin(xr, L.wv).reshape(B, T, c.n_head_kv, c.head_dim)
        q = rms_norm(q, L.q_norm, c.rms_eps).to(v.dtype)
        k = rms_norm(k, L.k_norm, c.rms_eps).to(v.dtype)
        q = rope_neox(q, pos, c.n_rot, c.rope_theta)
        k = rope_neox(k, pos, c.n_rot, c.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, h, T, hd]
        causal = True
        if st is not None:
            if "k" in st:
                k = torch.cat([st["k"], k], 2)
                v = torch.cat([st["v"], v], 2)
            st["k"], st["v"] = k, v
        rep = c.n_head // c.n_head_kv
        kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        Tk = kk.shape[2]
        if Tk == T:
            o = attention(q, kk, vv, causal=True)
        else:
            mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
            o = attention(q, kk, vv, mask=mask)
        o = o.transpose(1, 2).reshape(B, T, c.q_width)
        o = o * torch.sigmoid(gate.reshape(B, T, c.q_width))
        return self._lin(o, L.wo)

    def gdn_block(self, L, n, st):
        c = self.cfg
        B, T, _ = n.shape
        Hk, Hv, dk, dv, K = c.ssm_k_heads, c.ssm_v_heads, c.ssm_head_k, c.ssm_head_v, c.conv_kernel
        xr = n
        qkv = self._lin(xr, L.w_qkv)  # [B, T, conv_dim]
        z = self._lin(xr, L.w_gate)
        b = F.linear(n, bf16_ste(L.w_beta).to(n.dtype))
        a = F.linear(n, bf16_ste(L.w_alpha).to(n.dtype))
        # causal depthwise conv over [state (K-1 rows); qkv]
        prev = st["conv"] if (st is not None and "conv" in st) else qkv.new_zeros(B, K - 1, c.conv_dim)
        full = torch.cat([prev.to(qkv.dtype), qkv], 1)
        if st is not None:
            st["conv"] = full[:, -(K - 1):].detach()
        y = F.conv1d(full.transpose(1, 2), L.conv1d.to(full.dtype)[:, None, :], groups=c.conv_dim).transpose(1, 2)
        y = F.silu(y)
        q, k, v = y.split([Hk * dk, Hk * dk, Hv * dv], -1)
        q = l2norm(q.float().reshape(B, T, Hk, dk)) / math.sqrt(dk)
        k = l2norm(k.float().reshape(B, T, Hk, dk))
        v = v.float().reshape(B, T, Hv, dv)
        R = Hv // Hk
        q, k = q.repeat_interleave(R, 2), k.repeat_interleave(R, 2)  # grouped: V head p <- K head p // R
        beta = torch.sigmoid(b.float())
        ssm_a = L.ssm_a_exact if getattr(L, "ssm_a_exact", None) is not None else -L.A_log.float().exp()
        g = ssm_a * F.softplus(a.float() + L.dt_bias)
        S = st["S"] if (st is not None and "S" in st) else q.new_zeros(B, Hv, dk, dv)
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), S)
        if T <= 4:
            o, S = gdn_recurrent(*args)
        else:
            o, S = gdn_chunked(*args)
        if st is not None:
            st["S"] = S.detach()
        o = o.transpose(1, 2)  # [B, T, Hv, dv]
        o = rms_norm(o, L.ssm_norm, c.rms_eps) * F.silu(z.float().reshape(B, T, Hv, dv))
        o = o.reshape(B, T, c.inner).to(n.dtype)
        return self._lin(o, L.w_out)

    def ffn_block(self, L, n):
        xr = n
        h = F.silu(self._lin(xr, L.ffn_gate)) * self._lin(xr, L.ffn_up)
        return self._lin(h, L.ffn_down)

    def forward(self, ids, state=None, taps=(), pos0=0, logits=True, last_only=False):
        """ids [B, T]. state: None (no cache) or a list of per-layer dicts (filled/extended in place).
        Returns (logits [B, T, V] or None, taps [B, T, len(taps)*E] or None)."""
        c = self.cfg
        B, T = ids.shape
        pos = torch.arange(pos0, pos0 + T, device=ids.device)
        dt = torch.bfloat16 if torch.is_autocast_enabled() else torch.float32
        x = self.embed(ids).to(torch.float32)
        caps = {}
        for il, L in enumerate(self.layers):
            if il in taps:
                caps[il] = x
            st = state[il] if state is not None else None
            n = rms_norm(x, L.attn_norm, c.rms_eps).to(dt)
            if c.is_attention(il):
                y = self.attn_block(L, n, pos, st)
            else:
                y = self.gdn_block(L, n, st)
            x = x + y.float()
            n = rms_norm(x, L.post_attn_norm, c.rms_eps).to(dt)
            x = x + self.ffn_block(L, n).float()
        if c.n_layer in taps:
            caps[c.n_layer] = x
        tap_out = torch.cat([caps[t] for t in taps], -1) if taps else None
        out = None
        if logits:
            xs = x[:, -1:] if last_only else x
            h = rms_norm(xs, self.output_norm, c.rms_eps).to(dt)
            out = self.lm_head(h)
        return out, tap_out

    def new_state(self):
        return [dict() for _ in range(self.cfg.n_layer)]


def param_groups(model, wd):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "conv1d" not in name:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
