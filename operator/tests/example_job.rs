//! The example ElasticJobs (`examples/k8s/elasticjob.yaml`, and `elasticjob-ha.yaml` with a
//! state store) read into the Rust types and pass the CRD's CEL rules, evaluated offline;
//! broken variants of them are refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use hvd_operator::crd::ElasticJob;
use kube::core::cel::validate_cel;

fn example() -> ElasticJob {
    read("elasticjob.yaml")
}

/// `examples/k8s/<name>` as an ElasticJob.
fn read(name: &str) -> ElasticJob {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/k8s")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_norway::from_str(&text)
        .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()))
}

#[test]
fn example_parses_and_passes_the_cel_rules() {
    let job = example();
    assert!(job.spec.min_replicas <= job.spec.max_replicas);
    assert!(!job.spec.command.is_empty());
    validate_cel(&job).unwrap_or_else(|e| panic!("the example breaks a CEL rule: {e:?}"));
}

#[test]
fn cel_rules_refuse_bad_bounds() {
    let mut job = example();
    job.spec.min_replicas = job.spec.max_replicas + 1;
    job.spec.replicas = None;
    let err = format!("{:?}", validate_cel(&job).unwrap_err());
    assert!(err.contains("minReplicas must not exceed"), "{err}");

    let mut job = example();
    job.spec.replicas = Some(job.spec.max_replicas + 1);
    let err = format!("{:?}", validate_cel(&job).unwrap_err());
    assert!(err.contains("spec.replicas must lie within"), "{err}");

    let mut job = example();
    job.spec.blacklist.cooldown_range = Some([100, 10]);
    let err = format!("{:?}", validate_cel(&job).unwrap_err());
    assert!(err.contains("cooldownRange"), "{err}");

    let mut job = example();
    job.metadata.name = Some("x".repeat(46));
    let err = format!("{:?}", validate_cel(&job).unwrap_err());
    assert!(err.contains("at most 45"), "{err}");
}

#[test]
fn every_spec_key_of_the_example_is_in_the_schema() {
    // The API server prunes fields the structural schema does not declare; the example must not
    // rely on any. Every key of the example's spec is a property of the CRD's spec schema.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/k8s/elasticjob.yaml");
    let raw: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let crd = serde_json::to_value(<ElasticJob as kube::CustomResourceExt>::crd()).unwrap();
    let props = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    for key in raw["spec"].as_object().unwrap().keys() {
        assert!(
            props.get(key).is_some(),
            "spec.{key} is not in the CRD schema"
        );
    }
}

#[test]
fn the_state_store_example_parses_passes_and_drives_a_standby() {
    let job = read("elasticjob-ha.yaml");
    validate_cel(&job).unwrap_or_else(|e| panic!("the example breaks a CEL rule: {e:?}"));
    let store = job.spec.state_store.as_ref().expect("a stateStore");
    assert_eq!(store.endpoints, ["etcd.default.svc:2379"]);
    assert_eq!(store.credentials_secret.as_deref(), Some("etcd-auth"));
    let url = store.url("default", "mnist-ha", "u1").unwrap();
    assert_eq!(url, "etcd://etcd.default.svc:2379/hvd/default/mnist-ha/u1");

    let mut bad = job.clone();
    bad.spec.state_store.as_mut().unwrap().endpoints = vec!["etcd.default.svc".into()];
    let err = format!("{:?}", validate_cel(&bad).unwrap_err());
    assert!(
        err.contains("\\\"etcd.default.svc\\\" is not HOST:PORT"),
        "{err}"
    );
}

#[test]
fn every_state_store_key_of_the_example_is_in_the_schema() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/k8s/elasticjob-ha.yaml");
    let raw: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let crd = serde_json::to_value(<ElasticJob as kube::CustomResourceExt>::crd()).unwrap();
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    for key in raw["spec"].as_object().unwrap().keys() {
        assert!(
            spec.get(key).is_some(),
            "spec.{key} is not in the CRD schema"
        );
    }
    let store = &spec["stateStore"]["properties"];
    for key in raw["spec"]["stateStore"].as_object().unwrap().keys() {
        assert!(
            store.get(key).is_some(),
            "spec.stateStore.{key} is not in the CRD schema"
        );
    }
}
