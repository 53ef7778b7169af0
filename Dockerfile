# qstreamd for H100/H200 nodes. Build: docker build -t qstream .
# Run:   docker run --gpus all -p 50051:50051 -p 50052:50052 -p 9464:9464 \
#          -v $PWD/secrets/tls:/etc/qstream/tls:ro -v $PWD/secrets/auth:/etc/qstream/auth:ro qstream
# TLS and tokens are on by default (README "Security"): tls/tls.crt and
# tls/tls.key (PEM), auth/tokens (`<role> <token>` lines), all readable by
# uid 10001. Without them qstreamd exits at once naming the missing file.
# The builder runs the same install script and CMake build as CI.
ARG CUDA_VERSION=13.0.0
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive QSTREAM_SKIP_PIP=1
WORKDIR /src
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN ./deploy/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DQSTREAM_CUDA=ON \
 && cmake --build build -j"$(nproc)" --target qstreamd qstream-actor qstream-bench \
 && mkdir -p /out/bin /out/lib \
 && cp build/qstreamd build/qstream-actor build/qstream-bench /out/bin/ \
 && for b in /out/bin/*; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u \
    | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt|libcuda|libcudart|libcublas|libcublasLt)\.so' \
    | xargs -r -I{} cp -L {} /out/lib/

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
RUN groupadd --system --gid 10001 qstream && useradd --system --uid 10001 --gid 10001 qstream
# The gRPC, protobuf, abseil and prometheus-cpp libraries the binaries link,
# copied from the builder (CUDA's own libraries come with this image).
COPY --from=build /out/lib/ /usr/local/lib/qstream/
COPY --from=build /out/bin/ /usr/local/bin/
ENV LD_LIBRARY_PATH=/usr/local/lib/qstream
USER 10001:10001
EXPOSE 50051 50052 9464
ENTRYPOINT ["/usr/local/bin/qstreamd", "--listen=0.0.0.0:50051", \
            "--tls_cert=/etc/qstream/tls/tls.crt", "--tls_key=/etc/qstream/tls/tls.key", \
            "--auth_tokens=/etc/qstream/auth/tokens", "--health_listen=0.0.0.0:50052", \
            "--metrics_listen=0.0.0.0:9464", "--backend=auto"]
