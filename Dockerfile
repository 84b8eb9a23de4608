# mlaserve on a CUDA GPU (Hopper first). Not built in the project's CI: the development
# machines have no Docker engine. Build: docker build -t mlaserve .
# Run:   docker run --gpus all -p 8000:8000 -v /models:/models mlaserve /models/DeepSeek-R1 \
#            --tensor-parallel-size 8 --kv-cache-dtype fp8
# The devel image: it carries nvcc, which builds our CUDA C++ kernels (MLA decode, V4/V4.1 sparse
# decode, MXFP8 GEMM: below, at image build time, so containers start without compiling).
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 MLASERVE_KERNEL_CACHE=/opt/mlaserve/kernel-cache
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/mlaserve
# The CUDA 12.8 build of torch first, so the project's `torch` requirement is already met.
RUN pip install torch --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY server ./server
COPY model ./model
COPY kernels ./kernels
COPY distributed ./distributed
COPY configs ./configs
RUN pip install '.[gpu]'
RUN python3 -c "from server import envs; \
from kernels import mla_decode_cuda, mxfp8_gemm_cuda, v4_sparse_decode_cuda; \
[print(m.build_library(out_dir=envs.MLASERVE_KERNEL_CACHE)) for m in (mla_decode_cuda, v4_sparse_decode_cuda, mxfp8_gemm_cuda)]"

EXPOSE 8000
ENTRYPOINT ["mlaserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
# With no model argument the bundled tiny arithmetic model is served.
CMD []
