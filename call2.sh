export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -e ringflash/kernels ] || ln -s ../kernels ringflash/kernels; export PYTHONPATH=$PWD
date -u
timeout 170 python3 -m pytest -q -n 8 tests/test_hopper_forward.py tests/test_ring_steps_hopper.py tests/test_hopper_padding.py -p no:cacheprovider -p no:warnings > $OUT/pytest.log 2>&1; tail -6 $OUT/pytest.log
for v in new old; do
  [ $v = old ] && cp old_forward.py kernels/hopper/forward.py
  echo "=== $v"
  timeout 100 python3 launch/bench_masks.py --head-dims 128 64 --workloads docs8x8k docs32x2k docs-random --backends ringflash cudnn --json $OUT/masks_$v.json 2>$OUT/masks_$v.err | tail -9
  timeout 100 python3 launch/bench_attention.py --head-dims 64 128 --seqlens 4096 65536 --backends ringflash cudnn --json $OUT/dense_$v.json 2>$OUT/dense_$v.err | tail -9
done
