"""BlockTables for the CUDA tier: the core torch implementation with the per-batch gather and
slot mapping done by one Triton launch each (per KV-cache group), and no host synchronisation."""

from __future__ import annotations

import torch

from diffusion_kv.core.block_tables import TorchBlockTables


class TritonBlockTables(TorchBlockTables):
    def gather_block_tables(
        self, idx_mapping: torch.Tensor, num_reqs_padded: int
    ) -> tuple[torch.Tensor, ...]:
        from diffusion_kv.platforms.cuda import kernels

        idx = idx_mapping.to(device=self.device, dtype=torch.int32)
        return tuple(
            kernels.gather_block_table(table.gpu, self.num_blocks.gpu[g], idx, num_reqs_padded)
            for g, table in enumerate(self.block_tables)
        )

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> torch.Tensor:
        from diffusion_kv.platforms.cuda import kernels

        idx = idx_mapping.to(device=self.device, dtype=torch.int32)
        qsl = query_start_loc.to(device=self.device, dtype=torch.int32)
        out = torch.empty(
            (self.num_kv_cache_groups, num_tokens_padded), dtype=self.slot_mapping_dtype, device=self.device
        )
        for g, table in enumerate(self.block_tables):
            kernels.compute_slots(
                table.gpu,
                self.num_blocks.gpu[g],
                idx,
                qsl,
                positions,
                out[g],
                block_size=self.block_sizes[g],
                kernel_block_size=self.kernel_block_sizes[g],
                cp_size=self.cp_size,
                cp_rank=self.cp_rank,
                cp_interleave=self.cp_interleave,
            )
        return out
