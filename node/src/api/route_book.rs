//! A router that also keeps the list of what it serves: each path with its methods. The
//! API reference test (`tests/openapi.rs`) holds `docs/openapi.yaml` to this list in both
//! directions, and probes a live node so the list cannot claim a method the router does
//! not answer, nor miss one it does.

use std::sync::Arc;

use axum::http::Method;
use axum::routing::MethodRouter;
use axum::Router;

use crate::app::App;

pub struct RouteBook {
    router: Router<Arc<App>>,
    served: Vec<(Method, &'static str)>,
}

impl Default for RouteBook {
    fn default() -> Self {
        RouteBook {
            router: Router::new(),
            served: Vec::new(),
        }
    }
}

impl RouteBook {
    /// Serves `path` with `handler`, which answers exactly `methods`.
    pub fn route(
        mut self,
        path: &'static str,
        methods: &[Method],
        handler: MethodRouter<Arc<App>>,
    ) -> Self {
        self.router = self.router.route(path, handler);
        self.served
            .extend(methods.iter().map(|method| (method.clone(), path)));
        self
    }

    pub fn merge(mut self, other: RouteBook) -> Self {
        self.router = self.router.merge(other.router);
        self.served.extend(other.served);
        self
    }

    pub fn served(&self) -> &[(Method, &'static str)] {
        &self.served
    }

    pub fn into_router(self) -> Router<Arc<App>> {
        self.router
    }
}
