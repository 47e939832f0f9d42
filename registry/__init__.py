"""etcd-backed adapter metadata, artifact store, validation and the tenant API."""
