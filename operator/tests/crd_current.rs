//! The Helm chart's copy of the CRD is what `crdgen` prints from the Rust types.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn chart_crd_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/hvd/crds/elasticjob.yaml");
    let generated = hvd_operator::crd::crd_yaml().unwrap();
    let stored = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert!(
        stored == generated,
        "{} is out of date; regenerate with: \
         cargo run -p hvd-operator --bin crdgen > charts/hvd/crds/elasticjob.yaml",
        path.display()
    );
}
