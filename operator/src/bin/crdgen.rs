//! Prints the `ElasticJob` CRD as YAML: `cargo run -p hvd-operator --bin crdgen > charts/hvd/crds/elasticjob.yaml`.

fn main() -> anyhow::Result<()> {
    print!("{}", hvd_operator::crd::crd_yaml()?);
    Ok(())
}
