# qstreamd for H100/H200 nodes: docker build -t qstream:0.1.0 .
# (the tag is the CMake project version; deploy/k8s pins it, never `latest`).
# Run:   docker run --gpus all -p 50051:50051 -p 50052:50052 -p 9464:9464 \
#          -v $PWD/secrets/tls:/etc/qstream/tls:ro -v $PWD/secrets/auth:/etc/qstream/auth:ro qstream:0.1.0
# TLS and tokens are on by default (README "Security"): tls/tls.crt and
# tls/tls.key (PEM), auth/tokens (`<role> <token>` lines), all readable by
# uid 10001. Without them qstreamd exits at once naming the missing file.
#
# CUDA compatibility. CUDA_VERSION (default 12.8.1) picks the toolkit of the
# builder and the runtime libraries (cudart, cuBLAS) of the final image; the
# GPU node supplies the driver. A CUDA 12.x image runs on every R525+
# datacenter driver, so on the R535, R550 and R570 branches common on H100/H200
# node pools (CUDA minor-version compatibility; natively on R570+). This holds
# because the fatbin carries SASS for sm_90 and sm_90a (nothing is JIT-compiled
# from PTX, which an older driver may refuse); its compute_90 PTX only serves
# later GPUs. On R580+ drivers --build-arg CUDA_VERSION=13.0.0 works as well.
# CMAKE_CUDA_ARCHITECTURES (build arg, default 90-real;90a-real;90-virtual)
# sets that fatbin; deploy/build-image.sh checks it with cuobjdump.
#
# The builder installs with the same script as CI, and deploy/build-image.sh
# (configure, build, stage binaries plus their non-system shared libraries,
# check they run) is the one build step; CI runs the same script on its build.
# Not linted: no hadolint here. Keep each instruction plain.
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ARG CMAKE_CUDA_ARCHITECTURES="90-real;90a-real;90-virtual"
# .git is not in the build context: --build-arg QSTREAM_GIT_COMMIT=$(git rev-parse --short HEAD)
# puts the commit into qstream_build_info and the start-up line.
ARG QSTREAM_GIT_COMMIT=unknown
ENV DEBIAN_FRONTEND=noninteractive QSTREAM_SKIP_PIP=1
WORKDIR /src
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN ./deploy/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN QSTREAM_CUDA=ON CMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES}" QSTREAM_GIT_COMMIT="${QSTREAM_GIT_COMMIT}" \
    ./deploy/build-image.sh --work /src/build-image --out /out

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
RUN groupadd --system --gid 10001 qstream \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/qstream --no-create-home qstream \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/qstream
# The gRPC, protobuf, abseil, prometheus-cpp, OpenSSL ... libraries the
# binaries link, from the builder (CUDA's own libraries come with this image),
# found through ld.so.conf: LD_LIBRARY_PATH stays the base image's, where the
# NVIDIA container runtime may put the driver.
COPY --from=build /out/lib/ /usr/local/lib/qstream/
COPY --from=build /out/bin/ /usr/local/bin/
RUN echo /usr/local/lib/qstream > /etc/ld.so.conf.d/qstream.conf && ldconfig
USER 10001:10001
EXPOSE 50051 50052 9464
# grpc.health.v1 on the plaintext health port. Kubernetes ignores this (its
# probes are in deploy/k8s); start-period covers a checkpoint restore.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
  CMD ["/usr/local/bin/qstream-healthcheck", "127.0.0.1:50052"]
ENTRYPOINT ["/usr/local/bin/qstreamd", "--listen=0.0.0.0:50051", \
            "--tls_cert=/etc/qstream/tls/tls.crt", "--tls_key=/etc/qstream/tls/tls.key", \
            "--auth_tokens=/etc/qstream/auth/tokens", "--health_listen=0.0.0.0:50052", \
            "--metrics_listen=0.0.0.0:9464", "--backend=auto"]
