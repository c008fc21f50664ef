# The node agent image used by deploy/daemonset. NVML (libnvidia-ml.so.1) comes from the host's
# driver at run time (the NVIDIA container toolkit, or the driver root mounted by the DaemonSet).
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
