//! The operator's error type.

/// Why a reconcile (or a piece of one) failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The ElasticJob lacks a field the API server always sets (name, namespace, uid).
    #[error("the ElasticJob has no {0}")]
    MissingField(&'static str),
    /// A call to the Kubernetes API failed.
    #[error("Kubernetes API call failed: {0}")]
    Kube(#[from] kube::Error),
    /// The OS gave no randomness for the job's secret.
    #[error("no randomness for the job secret: {0}")]
    Random(String),
    /// Adding or removing the cleanup finalizer failed, or so did the work under it.
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// A status patch could not be serialized.
    #[error("cannot serialize the status: {0}")]
    Json(#[from] serde_json::Error),
    /// `spec.stateStore` names a bad endpoint or prefix (the CRD's rules were bypassed).
    #[error(transparent)]
    StateStore(#[from] crate::crd::StateStoreError),
}

impl Error {
    /// A short, stable label for logs and metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::MissingField(_) => "missing_field",
            Error::Kube(_) => "kube",
            Error::Random(_) => "random",
            Error::Finalizer(_) => "finalizer",
            Error::Json(_) => "json",
            Error::StateStore(_) => "state_store",
        }
    }
}
