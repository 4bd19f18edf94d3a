"""The DFlash 2 drafter (SPEC 4.2) in PyTorch, its training (SPEC 6), evaluation and GGUF export (SPEC 4.1).

The drafter computes exactly what src/models/dflash_drafter.cpp computes: context rows
c_j = enc_norm(fc . taps_j) (keys RoPE'd at j), block rows [anchor, MASK x 7] embedded with the TARGET's
embedding at positions P..P+7, per layer grouped dynamic causal conv around attention and MLP (kernel 2,
group 16, identity init), Qwen3-style attention (q/k RMSNorm, NeoX RoPE over the whole head, no gate),
non-causal inside the block, context j visible iff j < P and (P+i) - j < window; h = output_norm(x);
logits = target lm_head(h) for rows 1..7; selector S[k] = U[k] + sum_r pred[prev][r] g[r] succ[cand_k][r].
"""
import math
from dataclasses import dataclass, field, asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import gguf_io as G
from model import rms_norm, rope_neox, attention


def tap_layers(n_layer):
    """SPEC 6: zero-based outputs round(1 + i (N-4)/4), +1 as layer-input ids (SPEC 2.5)."""
    return [int(math.floor(1 + i * (n_layer - 4) / 4 + 0.5)) + 1 for i in range(5)]


@dataclass
class DrafterConfig:
    n_embd: int = 512
    n_vocab: int = 12288
    n_layer: int = 5
    n_head: int = 8
    n_head_kv: int = 4
    head_dim: int = 64
    n_ff: int = 1536
    block: int = 8
    taps: list = field(default_factory=lambda: [2, 3, 4, 5, 6])
    conv_kernel: int = 2
    conv_group: int = 16
    rank: int = 256
    top_k: int = 16
    window: int = 2048
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    mask_token: int = 0
    n_ctx_train: int = 4096
    seed: int = 99

    @property
    def groups(self):
        return self.n_embd // self.conv_group


class Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.cfg = c
        gen = torch.Generator().manual_seed(c.seed)
        E, K, Gr = c.n_embd, c.conv_kernel, c.groups

        def P(*shape, s=0.02):
            return nn.Parameter(torch.randn(*shape, generator=gen) * s)

        self.fc = P(E, len(c.taps) * E)
        self.enc_norm = nn.Parameter(torch.ones(E))
        self.out_norm = nn.Parameter(torch.ones(E))
        self.sel_hidden = nn.Parameter(torch.zeros(c.rank, E))
        self.pred = P(c.n_vocab, c.rank, s=0.5)
        self.succ = P(c.n_vocab, c.rank, s=0.5)
        base = torch.zeros(2, K, E)
        base[:, 0] = 1.0  # identity conv (SPEC 6)
        out_std = 0.02 / math.sqrt(2 * c.n_layer)
        self.layers = nn.ModuleList()
        for _ in range(c.n_layer):
            L = nn.Module()
            L.attn_norm = nn.Parameter(torch.ones(E))
            L.attn_conv_base = nn.Parameter(base.clone())
            L.attn_conv_proj = nn.Parameter(torch.zeros(2 * K * Gr, E))
            L.wq = P(c.n_head * c.head_dim, E)
            L.wk = P(c.n_head_kv * c.head_dim, E)
            L.wv = P(c.n_head_kv * c.head_dim, E)
            L.wo = P(E, c.n_head * c.head_dim, s=out_std)
            L.q_norm = nn.Parameter(torch.ones(c.head_dim))
            L.k_norm = nn.Parameter(torch.ones(c.head_dim))
            L.ffn_norm = nn.Parameter(torch.ones(E))
            L.ffn_conv_base = nn.Parameter(base.clone())
            L.ffn_conv_proj = nn.Parameter(torch.zeros(2 * K * Gr, E))
            L.ffn_gate = P(c.n_ff, E)
            L.ffn_up = P(c.n_ff, E)
            L.ffn_down = P(E, c.n_ff, s=out_std)
            self.layers.append(L)

    def dconv(self, y, base, d):
        """y [B, A, R, E]; base [K, E]; d [B, A, R, K, G] -> sum_o (base[o] + d[o]) * y[t - o] (zero before row 0)."""
        c = self.cfg
        out = None
        for o in range(c.conv_kernel):
            coef = base[o] + d[..., o, :].repeat_interleave(c.conv_group, -1)
            ys = y if o == 0 else F.pad(y, (0, 0, o, 0))[:, :, :y.shape[2]]
            term = coef * ys
            out = term if out is None else out + term
        return out

    def forward(self, target, taps, block_ids, anchors, ctx_valid=None):
        """taps [B, L, n_taps*E] (positions 0..L-1), block_ids [B, A, R], anchors [B, A] -> h [B, A, R, E]."""
        c = self.cfg
        B, A, R = block_ids.shape
        Lc = taps.shape[1]
        E, H, Hkv, hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        dt = torch.bfloat16 if torch.is_autocast_enabled() else torch.float32
        ctx = rms_norm(F.linear(taps.to(dt), self.fc.to(dt)), self.enc_norm, c.rms_eps).to(dt)  # [B, Lc, E]
        x = target.embed(block_ids).float()  # [B, A, R, E]
        pos_ctx = torch.arange(Lc, device=taps.device)
        pos_blk = (anchors[..., None] + torch.arange(R, device=taps.device)).reshape(B, A * R)
        # mask [B, 1, A*R, Lc + A*R]
        qpos = pos_blk[:, :, None]
        anc = anchors[:, :, None].expand(B, A, R).reshape(B, A * R, 1)
        m_ctx = (pos_ctx[None, None, :] < anc) & (qpos - pos_ctx[None, None, :] < c.window)
        if ctx_valid is not None:
            m_ctx = m_ctx & ctx_valid[:, None, :]
        blk_id = torch.arange(A, device=taps.device).repeat_interleave(R)
        m_blk = (blk_id[:, None] == blk_id[None, :])[None].expand(B, -1, -1)
        mask = torch.cat([m_ctx, m_blk], -1)[:, None]
        rep = H // Hkv
        Gr, K = c.groups, c.conv_kernel
        for L in self.layers:
            n = rms_norm(x, L.attn_norm, c.rms_eps).to(dt)
            d = F.linear(n, L.attn_conv_proj.to(dt)).float().reshape(B, A, R, 2, K, Gr)
            u = self.dconv(n.float(), L.attn_conv_base[0], d[..., 0, :, :]).to(dt).reshape(B, A * R, E)
            q = F.linear(u, L.wq.to(dt)).reshape(B, A * R, H, hd)
            kb = F.linear(u, L.wk.to(dt)).reshape(B, A * R, Hkv, hd)
            vb = F.linear(u, L.wv.to(dt)).reshape(B, A * R, Hkv, hd)
            kc = F.linear(ctx, L.wk.to(dt)).reshape(B, Lc, Hkv, hd)
            vc = F.linear(ctx, L.wv.to(dt)).reshape(B, Lc, Hkv, hd)
            q = rope_neox(rms_norm(q, L.q_norm, c.rms_eps).to(dt), pos_blk, hd, c.rope_theta)
            kb = rope_neox(rms_norm(kb, L.k_norm, c.rms_eps).to(dt), pos_blk, hd, c.rope_theta)
            kc = rope_neox(rms_norm(kc, L.k_norm, c.rms_eps).to(dt), pos_ctx, hd, c.rope_theta)
            k = torch.cat([kc, kb], 1).transpose(1, 2).repeat_interleave(rep, 1)
            v = torch.cat([vc, vb], 1).transpose(1, 2).repeat_interleave(rep, 1)
            o = attention(q.transpose(1, 2), k, v, mask=mask).transpose(1, 2).reshape(B, A * R, H * hd)
            o = F.linear(o, L.wo.to(dt)).float().reshape(B, A, R, E)
            x = x + self.dconv(o, L.attn_conv_base[1], d[..., 1, :, :])
            n2 = rms_norm(x, L.ffn_norm, c.rms_eps).to(dt)
            d2 = F.linear(n2, L.ffn_conv_proj.to(dt)).float().reshape(B, A, R, 2, K, Gr)
            u2 = self.dconv(n2.float(), L.ffn_conv_base[0], d2[..., 0, :, :]).to(dt)
            f = F.linear(F.silu(F.linear(u2, L.ffn_gate.to(dt))) * F.linear(u2, L.ffn_up.to(dt)), L.ffn_down.to(dt))
            x = x + self.dconv(f.float(), L.ffn_conv_base[1], d2[..., 1, :, :])
        return rms_norm(x, self.out_norm, c.rms_eps).to(dt)

    def selector_scores(self, h, cand, unary, prev):
        """h [..., E] rows 1..R-1, cand [..., k], unary [..., k], prev [...] -> S [..., k]."""
        g = F.linear(h.float(), self.sel_hidden)  # [..., rank]
        pg = self.pred[prev] * g
        return unary.float() + (pg[..., None, :] * self.succ[cand]).sum(-1)

    @torch.no_grad()
    def walk(self, h, logits, anchor_tok):
        """Greedy selector walk: h [N, R-1, E], logits [N, R-1, V], anchor_tok [N] -> drafts [N, R-1]."""
        vals, cand = logits.float().topk(self.cfg.top_k, -1)
        prev = anchor_tok
        out = []
        for p in range(h.shape[1]):
            S = self.selector_scores(h[:, p], cand[:, p], vals[:, p], prev)
            prev = cand[:, p].gather(-1, S.argmax(-1, keepdim=True))[:, 0]
            out.append(prev)
        return torch.stack(out, 1)


# ------------------------------------------------------------------------------------------------
# export

def export_drafter(dr: Drafter, path, heavy_layers=(2, 4)):
    c = dr.cfg
    w = G.GGUFWriter()
    p = "dflash."
    w.string("general.architecture", "dflash")
    w.string("general.name", "dflash tiny DFlash 2 drafter (trained)")
    w.string("general.type", "model")
    w.u32(p + "block_count", c.n_layer)
    w.u32(p + "context_length", c.n_ctx_train)
    w.u32(p + "embedding_length", c.n_embd)
    w.u32(p + "feed_forward_length", c.n_ff)
    w.u32(p + "attention.head_count", c.n_head)
    w.u32(p + "attention.head_count_kv", c.n_head_kv)
    w.u32(p + "attention.key_length", c.head_dim)
    w.u32(p + "attention.value_length", c.head_dim)
    w.f32(p + "attention.layer_norm_rms_epsilon", c.rms_eps)
    w.f32(p + "rope.freq_base", c.rope_theta)
    w.u32(p + "block_size", c.block)
    w.array(p + "target_layers", G.T_I32, c.taps)
    w.u32(p + "conv_kernel_size", c.conv_kernel)
    w.u32(p + "conv_group_size", c.conv_group)
    w.u32(p + "selector_rank", c.rank)
    w.u32(p + "selector_top_k", c.top_k)
    w.u32(p + "attention.sliding_window", c.window)
    w.boolean(p + "attention.causal", False)
    w.u32(p + "vocab_size", c.n_vocab)
    w.u32("tokenizer.ggml.mask_token_id", c.mask_token)

    def f32(t):
        return t.detach().float().cpu().numpy()

    def mat(name, prm, t=G.Q4_K):
        a = f32(prm)
        w.tensor(name, t, [a.shape[1], a.shape[0]], G.quantize(t, a))

    def vec(name, prm, ne=None):
        a = np.ascontiguousarray(f32(prm), np.float32)
        w.tensor(name, G.F32, ne or [a.size], a.reshape(-1).view(np.uint8))

    mat("fc.weight", dr.fc)
    vec("enc.output_norm.weight", dr.enc_norm)
    vec("output_norm.weight", dr.out_norm)
    mat("selector_hidden.weight", dr.sel_hidden)
    mat("selector_predecessor.weight", dr.pred)
    mat("selector_successor.weight", dr.succ)
    E, K = c.n_embd, c.conv_kernel
    for il, L in enumerate(dr.layers):
        b = f"blk.{il}."
        heavy = G.Q6_K if il in heavy_layers else G.Q4_K
        vec(b + "attn_norm.weight", L.attn_norm)
        vec(b + "attn_conv_base", L.attn_conv_base, [E, K, 2])
        mat(b + "attn_conv_proj.weight", L.attn_conv_proj)
        mat(b + "attn_q.weight", L.wq)
        mat(b + "attn_k.weight", L.wk)
        mat(b + "attn_v.weight", L.wv, heavy)
        vec(b + "attn_q_norm.weight", L.q_norm)
        vec(b + "attn_k_norm.weight", L.k_norm)
        mat(b + "attn_output.weight", L.wo)
        vec(b + "ffn_norm.weight", L.ffn_norm)
        vec(b + "ffn_conv_base", L.ffn_conv_base, [E, K, 2])
        mat(b + "ffn_conv_proj.weight", L.ffn_conv_proj)
        mat(b + "ffn_gate.weight", L.ffn_gate)
        mat(b + "ffn_up.weight", L.ffn_up)
        mat(b + "ffn_down.weight", L.ffn_down, heavy)
    w.write(path)


def quantize_in_place(dr: Drafter, heavy_layers=(2, 4)):
    """Replaces every exported matrix by its Q4_K/Q6_K round trip (to measure what the file computes)."""
    def rt(prm, t=G.Q4_K):
        a = prm.detach().float().cpu().numpy()
        q = G.quantize(t, a)
        back = G.dequantize(t, q.reshape(-1), a.size).reshape(a.shape)
        with torch.no_grad():
            prm.copy_(torch.from_numpy(back).to(prm.device))

    for prm in (dr.fc, dr.sel_hidden, dr.pred, dr.succ):
        rt(prm)
    for il, L in enumerate(dr.layers):
        heavy = G.Q6_K if il in heavy_layers else G.Q4_K
        for prm in (L.attn_conv_proj, L.wq, L.wk, L.wo, L.ffn_conv_proj, L.ffn_gate, L.ffn_up):
            rt(prm)
        rt(L.wv, heavy)
        rt(L.ffn_down, heavy)


def load_drafter_gguf(path, device="cpu"):
    """The inverse of export_drafter(): a Drafter with the file's (dequantized) weights."""
    r = G.GGUFReader(path)
    kv = r.kv
    p = "dflash."
    c = DrafterConfig(n_embd=kv[p + "embedding_length"], n_vocab=r.tensors["selector_predecessor.weight"][1][1],
                      n_layer=kv[p + "block_count"], n_head=kv[p + "attention.head_count"],
                      n_head_kv=kv[p + "attention.head_count_kv"], head_dim=kv[p + "attention.key_length"],
                      n_ff=kv[p + "feed_forward_length"], block=kv[p + "block_size"],
                      taps=[int(x) for x in kv[p + "target_layers"]], conv_kernel=kv[p + "conv_kernel_size"],
                      conv_group=kv[p + "conv_group_size"], rank=kv[p + "selector_rank"],
                      top_k=kv[p + "selector_top_k"], window=kv[p + "attention.sliding_window"],
                      rope_theta=kv[p + "rope.freq_base"], rms_eps=kv[p + "attention.layer_norm_rms_epsilon"],
                      mask_token=kv["tokenizer.ggml.mask_token_id"], n_ctx_train=kv[p + "context_length"])
    dr = Drafter(c)

    def T(name):
        return torch.from_numpy(np.ascontiguousarray(r.f32(name)))

    with torch.no_grad():
        dr.fc.copy_(T("fc.weight"))
        dr.enc_norm.copy_(T("enc.output_norm.weight"))
        dr.out_norm.copy_(T("output_norm.weight"))
        dr.sel_hidden.copy_(T("selector_hidden.weight"))
        dr.pred.copy_(T("selector_predecessor.weight"))
        dr.succ.copy_(T("selector_successor.weight"))
        for il, L in enumerate(dr.layers):
            b = f"blk.{il}."
            for nm, prm in (("attn_norm.weight", L.attn_norm), ("attn_conv_base", L.attn_conv_base),
                            ("attn_conv_proj.weight", L.attn_conv_proj), ("attn_q.weight", L.wq),
                            ("attn_k.weight", L.wk), ("attn_v.weight", L.wv), ("attn_q_norm.weight", L.q_norm),
                            ("attn_k_norm.weight", L.k_norm), ("attn_output.weight", L.wo),
                            ("ffn_norm.weight", L.ffn_norm), ("ffn_conv_base", L.ffn_conv_base),
                            ("ffn_conv_proj.weight", L.ffn_conv_proj), ("ffn_gate.weight", L.ffn_gate),
                            ("ffn_up.weight", L.ffn_up), ("ffn_down.weight", L.ffn_down)):
                prm.copy_(T(b + nm).reshape(prm.shape))
    return dr.to(device)
