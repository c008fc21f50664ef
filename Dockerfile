# The node agent image used by deploy/daemonset. It carries no NVIDIA files: NVML
# (libnvidia-ml.so.1) is loaded at run time from the driver root the DaemonSet mounts
# (TESSERA_DRIVER_ROOT; agent/nvml/loader.py finds it through the driver root's ld cache), and
# workload containers get the driver's files through the CDI specs the agent writes. The only
# NVIDIA-published package is nvidia-ml-py, NVML's Python bindings (ctypes, no library).
# tests/deploy/test_dockerfile.py checks this file, since images are not built in CI.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY dra_driver ./dra_driver
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
ENV PYTHONUNBUFFERED=1
# root: the agent opens device nodes, makes MIG capability nodes and writes root-owned host
# directories (daemonset.yaml, securityContext)
USER 0
ENTRYPOINT ["tessera"]
CMD ["run"]
