"""The GPU benchmark's reference and oracle: genlm's ``ParallelTokenCharacterTrie`` on the
device (genlm.backend's own object where it imports, else its algorithm rebuilt from
genlm_fast's layout), whose device time the speedups compare with, and the float64 node
values every result is checked against, computed from the reference's own ancestor matrix."""

from __future__ import annotations

import warnings

from tools.gpu.measure import sync


class Reference:
    """genlm's ParallelTokenCharacterTrie algorithm, on the device: the package's own object
    when ``genlm.backend`` imports (and ``inline`` is False), else rebuilt from the layout."""

    def __init__(self, vocab, layout, device, inline: bool = False):
        self.device = device
        self.source = None
        why = "--inline-reference"
        if not inline:
            try:
                from genlm.backend.tokenization import Token as RefToken
                from genlm.backend.trie import ParallelTokenCharacterTrie

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trie = ParallelTokenCharacterTrie(
                        [RefToken(t.token_id, t.byte_string) for t in vocab], device=device.type
                    )
                import numpy as np

                # node-wise comparisons need genlm's numbering: genlm_fast's TokenByteTrie is
                # genlm's character trie plus an EOS node numbered just before the root
                if len(trie.children) != layout.num_nodes - 1 or not np.array_equal(
                    np.asarray(trie.idx_to_leaf)[:, 1], np.asarray(layout.leaf_node)
                ):
                    raise ValueError(
                        "it numbers the trie's nodes differently from genlm_fast "
                        "(a genlm_fast bug: tests/ should have caught it)"
                    )
                self.trie, self.M, self.positions = trie, trie.M, trie.positions
                self.src, self.dst = trie.src_indices, trie.dst_indices
                self.source = "genlm.backend ParallelTokenCharacterTrie (installed package)"
            except Exception as e:  # noqa: BLE001 -- not installed, or unusable here
                why = f"genlm.backend not usable: {type(e).__name__}: {e}"
        if self.source is None:
            self.trie = None
            self.M, self.positions, self.src, self.dst = self._ancestor_matrix(layout, device)
            self.source = (
                "inline re-implementation of genlm.backend's ParallelTokenCharacterTrie "
                f"algorithm ({why})"
            )
        self.num_nodes = self.M.shape[1]
        # the oracle's columns: genlm's character trie has no EOS node; genlm_fast's
        # TokenByteTrie numbers one just before the root (empty in without_eos mode)
        self.char_trie_columns = self.num_nodes == layout.num_nodes - 1
        self._M64 = None
        sync(device)

    @staticmethod
    def _ancestor_matrix(layout, device):
        """CSR [V, N]: row i has a 1 at the leaf of vocabulary position i and every ancestor."""
        import numpy as np
        import torch

        parent = np.asarray(layout.parent, dtype=np.int64)
        cur = np.asarray(layout.leaf_node, dtype=np.int64)
        rows_all, cols_all = [], []
        idx = np.arange(len(cur))
        while len(idx):
            rows_all.append(idx)
            cols_all.append(cur)
            up = parent[cur]
            keep = up >= 0
            idx, cur = idx[keep], up[keep]
        rows = torch.from_numpy(np.concatenate(rows_all))
        cols = torch.from_numpy(np.concatenate(cols_all))
        indices = torch.stack([rows, cols]).to(device)
        values = torch.ones(indices.shape[1], device=device)
        M = torch.sparse_coo_tensor(indices, values, (len(layout.leaf_node), layout.num_nodes))
        M = M.coalesce().to_sparse_csr()
        positions = torch.arange(len(layout.leaf_node), device=device)
        return M, positions, indices[0].contiguous(), indices[1].contiguous()

    def device_sum(self, ws):
        """The reference's device work for batch_weight_sum (no host copy)."""
        import torch

        return torch.sparse.mm(ws[:, self.positions], self.M)

    def device_max(self, ws):
        """The reference's device work for batch_weight_max (scatter_reduce amax)."""
        import torch

        leaf = ws[:, self.positions]
        out = torch.zeros(ws.shape[0], self.num_nodes, device=ws.device, dtype=ws.dtype)
        return out.scatter_reduce_(
            1,
            self.dst.expand(ws.shape[0], -1),
            leaf[:, self.src],
            reduce="amax",
            include_self=False,
        )

    def device_log_mass(self, logits):
        """log_softmax, exp, the sparse product, log: the reference's log-mass, on the device."""
        import torch

        return torch.log(self.device_sum(torch.log_softmax(logits, dim=-1).exp()))

    def oracle(self, op, logits, probs):
        """Float64 node values ``[B, N_ref]`` (numpy) from the reference's own ancestor matrix:
        sums as a float64 sparse product, max as a float64 scatter amax, log-masses as the log
        of the float64 sum of float64 softmax probabilities. With genlm.backend installed this
        owes nothing to genlm_fast's layout."""
        import numpy as np
        import torch

        if self._M64 is None:
            self._M64 = self.M.to(torch.float64)
        if op == "max":
            ws = probs.double()
            leaf = ws[:, self.positions]
            out = torch.zeros(ws.shape[0], self.num_nodes, device=ws.device, dtype=torch.float64)
            out.scatter_reduce_(
                1,
                self.dst.expand(ws.shape[0], -1),
                leaf[:, self.src],
                reduce="amax",
                include_self=False,
            )
            return out.cpu().numpy()
        ws = torch.softmax(logits.double(), dim=-1) if op == "log_mass" else probs.double()
        out = torch.sparse.mm(ws[:, self.positions], self._M64).cpu().numpy()
        if op == "log_mass":
            with np.errstate(divide="ignore"):
                return np.log(out)
        return out

    def char_columns(self, want):
        """``want`` without genlm_fast's EOS column, to compare with a character trie."""
        import numpy as np

        if self.char_trie_columns:
            return want
        n = want.shape[1]
        return np.concatenate([want[:, : n - 2], want[:, n - 1 :]], axis=1)

    def api_sum(self, ws):
        """The full reference call (row loop, device work, copy to host) when available."""
        return (
            self.trie.batch_weight_sum(ws)
            if self.trie is not None
            else self.device_sum(ws).cpu().numpy()
        )
