# The node agent image used by deploy/daemonset. It carries no NVIDIA files: NVML
# (libnvidia-ml.so.1) must come from the host's driver at run time, which today means the NVIDIA
# container toolkit injecting it into this container (loading it from the driver root the
# DaemonSet mounts is planned work, not done yet).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY dra_driver ./dra_driver
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
ENV PYTHONUNBUFFERED=1
USER 0
ENTRYPOINT ["tessera"]
CMD ["run"]
