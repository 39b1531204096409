export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 200 python3 -m pytest -q -x tests/test_cuda_graphs.py -m "gpu or multigpu" > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -3 $OUT/tests.log
timeout 70 python3 launch/bench_host.py --ab-binding --rounds 5 --calls 1000 > $OUT/single.log 2>&1; echo "single rc $?"; grep -v Warn $OUT/single.log
timeout 80 torchrun --nproc-per-node 2 launch/bench_host.py --heads 2 --calls 300 --rounds 3 --entries sdpa_cudnn ring_flash_attn_func zigzag_ring_flash_attn_func "sp_attn_func[ulysses]" > $OUT/ranks.log 2>&1; echo "ranks rc $?"; grep -v "Warn\|return func\|^W1128\|\*\*\*" $OUT/ranks.log | tail -6
