"""Infini-attention's compressive-memory kernels (Triton): ``memory`` (the linear update's
per-segment updates and their scan), ``retrieval`` (reading the memory and the gate, forward and
backward), ``delta`` (the delta rule's recurrence over segments), ``local`` (the local
attention's backward with the memory updates' backward added). The local attention is the
ordinary varlen attention; ``ringflash.infini`` puts them together."""
