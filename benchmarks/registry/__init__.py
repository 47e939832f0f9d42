"""`loraplex bench registry`: registrations, propagation and resync on a real etcd."""
