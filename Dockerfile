# One image for every hvd role on Kubernetes: the operator (hvd-operator, crdgen), the driver
# (horovodrun), the per-pod agent (hvd-agent) and the example training programs.
#
#   docker build -t hvd:0.1.0 .

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins -p hvd-driver -p hvd-agent -p hvd-operator \
 && cargo build --release --locked -p hvd --example elastic_train --example elastic_counter \
 && mkdir -p /out \
 && cp target/release/horovodrun target/release/hvd-agent target/release/hvd-operator \
       target/release/crdgen target/release/examples/elastic_train \
       target/release/examples/elastic_counter /out/

FROM debian:bookworm-slim
# ca-certificates: for API servers and registries outside the cluster's own CA. Unpinned: the
# bookworm security updates of it are wanted.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 hvd \
 && useradd --uid 10001 --gid hvd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin hvd
COPY --from=build /out/ /usr/local/bin/
USER 10001:10001
CMD ["hvd-operator"]
