# maskedit on NVIDIA's Triton container. 24.12 ships tritonserver 2.53 on Ubuntu 24.04 with Python 3.12: the pinned
# diffusers 0.42 and transformers 5.23 need Python >= 3.11, which 24.10 (tritonserver 2.51, as embedded; Python 3.10)
# lacks. The Triton behaviours docs/ describe were tried on the embedded 2.51.
#   docker build -t maskedit .
#   docker run --gpus all --shm-size 2g -p 8000-8002:8000-8002 -v /path/to/FLUX.1-Fill-dev:/models/flux-fill \
#     -e MASKEDIT_MODEL_DIR=/models/flux-fill -e MASKEDIT_DTYPE=bfloat16 maskedit
FROM nvcr.io/nvidia/tritonserver:24.12-py3

WORKDIR /opt/maskedit
# CUDA 12.6 build of torch, for the container's CUDA 12.6.3 (the CPU pin in requirements.txt is for dev/CI); installed
# first, at a version every serving pin accepts (cache-dit needs >= 2.7.1), so requirements-serve.txt keeps it.
RUN pip install --no-cache-dir torch==2.9.1 --index-url https://download.pytorch.org/whl/cu126
COPY requirements-serve.txt ./
RUN pip install --no-cache-dir -r requirements-serve.txt

COPY pyproject.toml ./
COPY common ./common
COPY python_backends ./python_backends
COPY client ./client
# The router (also the Kubernetes endpoint picker and the Triton pods' readiness probe) runs from this image too;
# it imports only `common` of the server side (its cost model, settings and log format).
COPY router ./router
COPY perf_profiles/cost_model_bench-flux-fill.json ./perf_profiles/
COPY model_repository ./model_repository
RUN pip install --no-cache-dir --no-deps -e . \
 && python3 -m maskedit.repository --kind gpu --out /opt/maskedit/model_repository_gpu \
 && python3 -m maskedit.build_model /opt/maskedit/models/tiny-flux-fill

# The model.py shims put these first on the stub's sys.path.
ENV MASKEDIT_PYTHONPATH=/opt/maskedit/python_backends:/opt/maskedit/common:/opt/maskedit/client \
    MASKEDIT_MODEL_DIR=/opt/maskedit/models/tiny-flux-fill

EXPOSE 8000 8001 8002
# The header patterns: the endpoint picker's tenant headers reach fair share (maskedit_common.tenant_wire).
# --disable-auto-complete-config as the launcher: every config.pbtxt is complete, and without it the Python backend
# starts one more stub per model only to ask it for a config (torch and the pipeline imported twice per load).
CMD ["tritonserver", "--model-repository=/opt/maskedit/model_repository_gpu", "--strict-readiness=true", \
     "--disable-auto-complete-config", \
     "--backend-config=python,shm-default-byte-size=16777216", \
     "--backend-config=python,shm-growth-byte-size=16777216", \
     "--grpc-header-forward-pattern=^x-maskedit-tenant(-weight)?$", \
     "--http-header-forward-pattern=^x-maskedit-tenant(-weight)?$"]
