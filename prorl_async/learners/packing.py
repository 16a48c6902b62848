"""Arrow-native learner input and sequence packing: rollout rows -> padding-free micro-batches.

Three pure steps, none of which builds a Python list per token:

1. :func:`list_column` reads a ``list<...>`` column of the rollout table (``prompt_ids``,
   ``response_ids``, ``behavior_logprobs``) as ``(values, offsets)`` numpy arrays straight
   from Arrow's buffers (zero-copy for a single-chunk column); display columns such as
   ``response_text`` are never touched.
2. :func:`plan_micro_batches` assigns rows to micro-batches of at most
   ``micro_batch_tokens`` prompt+response tokens (first-fit decreasing), like OpenRLHF's
   ``packing_samples`` and verl's dynamic batch size (``use_dynamic_bsz`` /
   ``ppo_max_token_len_per_gpu``).
3. :func:`pack_micro_batch` concatenates the chosen sequences into one row without padding:
   ``position_ids`` restart at 0 for every sequence, which is how transformers (>= 4.56,
   ``masking_utils.find_packed_sequence_indices``) detects packed sequences when no
   ``attention_mask`` is given and keeps attention inside each sequence (a block-diagonal
   causal mask for sdpa / eager, varlen kernels for flash attention).

:func:`prorl_async.learners.logprobs.packed_logprobs` runs an HF causal LM on a packed
micro-batch (passing the sequence boundaries to the attention of
:mod:`prorl_async.learners.attention`) and computes the response tokens' logprobs (and entropy)
on the response positions only, so neither padding nor prompt positions reach the LM head.
Token tensors of a micro-batch are *response-token aligned*: entry ``k`` is response token
``k`` of the micro-batch, in row order; ``token_rows`` maps it to its table row, so per-row
values (advantages, rewards) broadcast with ``per_row[mb.token_rows]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import torch

LEARNER_LIST_COLUMNS = ("prompt_ids", "response_ids", "behavior_logprobs")


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of list column ``name``: row ``i`` is ``values[offsets[i]:offsets[i+1]]``.

    ``offsets`` has ``num_rows + 1`` entries (int64, starting anywhere: a sliced table keeps
    its parent's buffers). Zero-copy when the column is one chunk without nulls.
    """
    if name not in table.column_names:
        raise KeyError(f"rollout table has no column {name!r} (columns: {table.column_names})")
    col = table.column(name)
    arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise TypeError(f"rollout column {name!r} must be a list column, got {arr.type}")
    if arr.null_count:
        raise ValueError(f"rollout column {name!r} has {arr.null_count} null rows; every sample needs a list "
                         "(empty for none)")
    offsets = np.asarray(arr.offsets).astype(np.int64, copy=False)
    values = arr.values.to_numpy(zero_copy_only=arr.values.null_count == 0)
    return values, offsets


def plan_micro_batches(seq_lens: np.ndarray, micro_batch_tokens: int) -> list[np.ndarray]:
    """Rows grouped into micro-batches of at most ``micro_batch_tokens`` tokens each.

    seq_lens: ``[n_rows]`` prompt+response length of every row. First-fit decreasing, so
    micro-batches come out nearly full; each returned array holds row indices in ascending
    order, and every row appears exactly once.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if micro_batch_tokens <= 0:
        raise ValueError(f"train.micro_batch_tokens must be positive, got {micro_batch_tokens}")
    if seq_lens.size and int(seq_lens.max()) > micro_batch_tokens:
        raise ValueError(f"a sequence of {int(seq_lens.max())} tokens does not fit train.micro_batch_tokens="
                         f"{micro_batch_tokens}; raise it to at least max prompt + response length")
    order = np.argsort(-seq_lens, kind="stable")
    free: list[int] = []
    members: list[list[int]] = []
    for row in order.tolist():  # one Python step per row, none per token
        n = int(seq_lens[row])
        for b, room in enumerate(free):
            if room >= n:
                free[b] -= n
                members[b].append(row)
                break
        else:
            free.append(micro_batch_tokens - n)
            members.append([row])
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


@dataclass
class PackedMicroBatch:
    """One padding-free micro-batch of ``S`` sequences, ``N`` tokens, ``M`` response tokens.

    input_ids, position_ids: ``[1, N]`` int64, sequences back to back; positions restart at 0.
    cu_seqlens: ``[S + 1]`` int32 sequence boundaries in the packed row (flash-attn varlen style).
    rows: ``[S]`` int64 table rows of the sequences, ascending.
    loss_index: ``[M]`` int64 packed positions whose next token is a response token.
    targets: ``[M]`` int64 the response tokens (``input_ids[0, loss_index + 1]``).
    token_rows: ``[M]`` int64 table row of each response token.
    behavior_logprobs: ``[M]`` float32 engine logprobs of the response tokens (or None).
    path_index, owner: ``None`` unless sequences share a prefix (:func:`pack_shared_micro_batch`):
    then ``path_index`` ``[V]`` int64 lists each sequence's packed positions from its first
    token to its last (sequence after sequence, ``cu_seqlens`` cutting them), and ``owner``
    ``[N]`` int64 the entry of ``path_index`` whose attention output each packed position takes.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    loss_index: torch.Tensor
    targets: torch.Tensor
    token_rows: torch.Tensor
    behavior_logprobs: Optional[torch.Tensor]
    path_index: Optional[torch.Tensor] = None
    owner: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def sequence_tokens(self) -> int:
        """Prompt+response tokens of the sequences (``num_tokens`` plus the shared ones)."""
        return int(self.cu_seqlens[-1])

    def to(self, device) -> "PackedMicroBatch":
        return PackedMicroBatch(*[None if t is None else t.to(device) for t in (
            self.input_ids, self.position_ids, self.cu_seqlens, self.rows, self.loss_index, self.targets,
            self.token_rows, self.behavior_logprobs, self.path_index, self.owner)])


def pack_micro_batch(prompt: tuple[np.ndarray, np.ndarray], response: tuple[np.ndarray, np.ndarray],
                     rows: np.ndarray, behavior: Optional[tuple[np.ndarray, np.ndarray]] = None
                     ) -> PackedMicroBatch:
    """Pack ``rows`` of the ``(values, offsets)`` columns (from :func:`list_column`) into one row.

    ``behavior`` (response-aligned, same offsets layout as ``response``) is gathered with the
    response tokens. Every prompt must have at least one token (it predicts the first response
    token). Vectorised: numpy index arithmetic over all tokens at once.
    """
    (pv, po), (rv, ro) = prompt, response
    rows = np.asarray(rows, dtype=np.int64)
    p_start, plen = po[rows], po[rows + 1] - po[rows]
    r_start, rlen = ro[rows], ro[rows + 1] - ro[rows]
    if rows.size and int(plen.min()) < 1:
        raise ValueError("every rollout row needs a non-empty prompt_ids (its last token predicts the first "
                         "response token)")
    seq = plen + rlen
    starts = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(seq, out=starts[1:])
    n = int(starts[-1])
    seg = np.repeat(np.arange(rows.size), seq)
    pos = np.arange(n, dtype=np.int64) - starts[seg]
    in_prompt = pos < plen[seg]
    resp = ~in_prompt
    ids = np.empty(n, dtype=np.int64)
    ids[in_prompt] = pv[(p_start[seg] + pos)[in_prompt]]
    r_idx = (r_start[seg] + pos - plen[seg])[resp]  # response tokens in row order
    ids[resp] = rv[r_idx]
    loss_index = np.flatnonzero(resp) - 1
    beh = None
    if behavior is not None:
        bv, bo = behavior
        if not np.array_equal(bo[rows + 1] - bo[rows], rlen):
            raise ValueError("behavior_logprobs must have one entry per response token")
        beh = torch.from_numpy(bv[(bo[rows][seg] + pos - plen[seg])[resp]].astype(np.float32, copy=False))
    return PackedMicroBatch(
        input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(pos)[None],
        cu_seqlens=torch.from_numpy(starts.astype(np.int32)), rows=torch.from_numpy(rows.copy()),
        loss_index=torch.from_numpy(loss_index), targets=torch.from_numpy(ids[resp]),
        token_rows=torch.from_numpy(rows[seg[resp]]), behavior_logprobs=beh)


# ---------------------------------------------------------------------- shared prefixes
def _token_matrix(prompt: tuple[np.ndarray, np.ndarray], response: tuple[np.ndarray, np.ndarray],
                  rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[len(rows), L]`` int32 prompt+response tokens of ``rows`` (-1 past each sequence's end),
    the sequence lengths and the prompt lengths. int32 as the rollout schema stores token ids:
    half the bytes to build, sort and compare of an int64 matrix."""
    (pv, po), (rv, ro) = prompt, response
    plen, rlen = po[rows + 1] - po[rows], ro[rows + 1] - ro[rows]
    lens = plen + rlen
    mat = np.full((rows.size, int(lens.max()) if rows.size else 0), -1, dtype=np.int32)
    seg = np.repeat(np.arange(rows.size), lens)
    pos = np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    in_p = pos < plen[seg]
    sp, rp = seg[in_p], seg[~in_p]
    mat[sp, pos[in_p]] = pv[po[rows][sp] + pos[in_p]]
    mat[rp, pos[~in_p]] = rv[ro[rows][rp] + pos[~in_p] - plen[rp]]
    return mat, lens, plen


def prefix_order(mat: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a token matrix (:func:`_token_matrix`) in lexicographic order, and each sorted
    row's common prefix with the row before it (0 for the first). That is the depth-first order
    of the sequences' prefix tree (trie): sorted row ``i`` shares its first ``lcp[i]`` tokens
    with row ``i - 1`` (no earlier row shares more) and adds ``lens - lcp`` new nodes.

    Any total order of the tokens gives a trie order, so the rows are sorted as byte strings
    (each row one opaque big-endian record, compared like ``memcmp``) in one ``argsort``: 5-8x
    faster than ``np.lexsort`` over every column at 1-8K-token rows (the end marker -1 sorts after
    every token; a row that is a prefix of another still sits next to its extensions)."""
    n, width = mat.shape
    order = np.arange(n)
    lcp = np.zeros(n, dtype=np.int64)
    if n > 1 and width:
        keys = np.ascontiguousarray(mat, dtype=">i4").view(np.dtype((np.void, 4 * width))).ravel()
        order = np.argsort(keys, kind="stable")
        s, ls = mat[order], lens[order]
        eq = (s[1:] == s[:-1]) & (np.arange(width)[None, :] < np.minimum(ls[1:], ls[:-1])[:, None])
        lcp[1:] = np.where(eq.all(axis=1), width, eq.argmin(axis=1))
    return order, lcp


def pack_shared_micro_batch(prompt: tuple[np.ndarray, np.ndarray], response: tuple[np.ndarray, np.ndarray],
                            rows: np.ndarray, behavior: Optional[tuple[np.ndarray, np.ndarray]] = None
                            ) -> PackedMicroBatch:
    """Pack ``rows`` with every shared prefix once: the nodes of the sequences' prefix tree.

    Sequences that begin with the same tokens -- the ``n`` samples of a group share their
    prompt, every prompt of a chat template shares its system prompt, samples often share their
    first response tokens -- have the same hidden states there (causal attention, same
    positions), so the packed row holds each distinct prefix token once, at its depth as
    position id, and :func:`~prorl_async.learners.attention.varlen_sdpa_attention` gives each
    sequence causal attention over its own path through the tree (``path_index``, cut by
    ``cu_seqlens``). Response token ``k`` of a row is predicted from the node of its own token
    ``k - 1`` (``loss_index``; the last prompt token's node is shared by the group). Exact: the
    same logprobs and gradients as
    :func:`pack_micro_batch` to float tolerance, for ``N`` = tree nodes instead of the
    sequences' summed lengths. As prefix sharing does for GRPO groups in "Prefix Grouper:
    Efficient GRPO Training through Shared-Prefix Forward" (Liu et al., 2025), generalised
    from the prompt to every common prefix. Falls back to :func:`pack_micro_batch` when no two
    sequences share a token."""
    rows = np.asarray(rows, dtype=np.int64)
    mat, lens, plen = _token_matrix(prompt, response, rows)
    if rows.size and int(plen.min()) < 1:
        raise ValueError("every rollout row needs a non-empty prompt_ids (its last token predicts the first "
                         "response token)")
    order, lcp = prefix_order(mat, lens)
    if not lcp.any():
        return pack_micro_batch(prompt, response, rows, behavior)
    n = rows.size
    ls = lens[order]
    new = ls - lcp
    start = np.cumsum(new) - new
    node_sorted = np.empty(mat.shape, dtype=np.int64)  # tree node of (sorted row, depth)
    for i in range(n):  # one Python step per row, none per token
        k, end = int(lcp[i]), int(ls[i])
        node_sorted[i, :k] = node_sorted[i - 1, :k]
        node_sorted[i, k:end] = start[i] + np.arange(end - k)
    node = np.empty_like(node_sorted)
    node[order] = node_sorted  # rows order
    creator = np.repeat(order, new)  # the row that adds each node, nodes in packed order
    depth = np.arange(int(new.sum()), dtype=np.int64) - np.repeat(start, new) + np.repeat(lcp, new)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    vseg = np.repeat(np.arange(n), lens)
    path_index = node[vseg, np.arange(int(cu[-1]), dtype=np.int64) - cu[vseg]]
    rlen = lens - plen
    rseg = np.repeat(np.arange(n), rlen)
    k = np.arange(int(rlen.sum()), dtype=np.int64) - np.repeat(np.cumsum(rlen) - rlen, rlen)
    at = plen[rseg] + k  # depth of response token k
    beh = None
    if behavior is not None:
        bv, bo = behavior
        if not np.array_equal(bo[rows + 1] - bo[rows], rlen):
            raise ValueError("behavior_logprobs must have one entry per response token")
        beh = torch.from_numpy(bv[bo[rows][rseg] + k].astype(np.float32, copy=False))
    return PackedMicroBatch(
        input_ids=torch.from_numpy(mat[creator, depth].astype(np.int64))[None], position_ids=torch.from_numpy(depth)[None],
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)), rows=torch.from_numpy(rows.copy()),
        loss_index=torch.from_numpy(node[rseg, at - 1]), targets=torch.from_numpy(mat[rseg, at].astype(np.int64)),
        token_rows=torch.from_numpy(rows[rseg]), behavior_logprobs=beh,
        path_index=torch.from_numpy(path_index), owner=torch.from_numpy(cu[creator] + depth))


def plan_shared_micro_batches(prompt: tuple[np.ndarray, np.ndarray], response: tuple[np.ndarray, np.ndarray],
                              rows: np.ndarray, micro_batch_tokens: int) -> list[np.ndarray]:
    """``rows`` (table indices) in micro-batches of at most ``micro_batch_tokens`` packed tokens,
    a shared prefix counted once (:func:`pack_shared_micro_batch`).

    Rows go in prefix-tree order; a row joins the micro-batch of the row before it when it fits
    there with the prefix they share not counted, otherwise the first micro-batch it fits whole.
    Without any shared prefix: :func:`plan_micro_batches`."""
    rows = np.asarray(rows, dtype=np.int64)
    mat, lens, _ = _token_matrix(prompt, response, rows)
    order, lcp = prefix_order(mat, lens)
    if not lcp.any() or micro_batch_tokens <= 0 or int(lens.max()) > micro_batch_tokens:
        return [rows[p] for p in plan_micro_batches(lens, micro_batch_tokens)]  # (or its error naming the setting)
    free: list[int] = []
    members: list[list[int]] = []
    prev_bin = -1
    for i, j in enumerate(order.tolist()):
        n = int(lens[j])
        if prev_bin >= 0 and free[prev_bin] >= n - int(lcp[i]):
            b, cost = prev_bin, n - int(lcp[i])
        else:
            b, cost = next((b for b, room in enumerate(free) if room >= n), len(free)), n
            if b == len(free):
                free.append(micro_batch_tokens)
                members.append([])
        free[b] -= cost
        members[b].append(j)
        prev_bin = b
    return [np.sort(rows[np.asarray(m, dtype=np.int64)]) for m in members]


def pack_rollouts(table: pa.Table, micro_batch_tokens: int, share_prefixes: bool = False) -> list[PackedMicroBatch]:
    """The rollout table's ``prompt_ids`` / ``response_ids`` / ``behavior_logprobs`` as
    padding-free micro-batches of at most ``micro_batch_tokens`` tokens (see module docstring);
    ``share_prefixes``: common prefixes once (:func:`pack_shared_micro_batch`)."""
    prompt, response = list_column(table, "prompt_ids"), list_column(table, "response_ids")
    behavior = list_column(table, "behavior_logprobs") if "behavior_logprobs" in table.column_names else None
    if share_prefixes:
        return [pack_shared_micro_batch(prompt, response, rows, behavior)
                for rows in plan_shared_micro_batches(prompt, response, np.arange(table.num_rows), micro_batch_tokens)]
    seq_lens = np.diff(prompt[1]) + np.diff(response[1])
    return [pack_micro_batch(prompt, response, rows, behavior)
            for rows in plan_micro_batches(seq_lens, micro_batch_tokens)]
