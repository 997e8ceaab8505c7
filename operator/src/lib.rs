//! The `ElasticJob` operator: the custom resource and its reconciler.
