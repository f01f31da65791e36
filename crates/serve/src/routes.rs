//! The gateway's routes: one table ([`Route`]: methods and OpenAPI path
//! template of each), the classifier that maps a request to a route (rLLM's
//! matching rules, contract §1), and the OpenAPI document that describes
//! them (`openapi.json` beside this file, hand-written, served at
//! `GET /openapi.json`; `GET /docs` lists it as HTML).
//!
//! Invariant, checked by this module's tests: the table, the classifier and
//! the document agree. Every (method, template) of the table is in the
//! document and the document has no other; each template, filled in with
//! sample parameters, classifies to its own route. The dispatcher
//! (`server.rs`) matches on [`Route`] exhaustively, so a new route must be
//! added to the table, and so to the document, before it can be served.

/// The OpenAPI 3.1 document, served verbatim.
pub(crate) const OPENAPI_JSON: &str = include_str!("openapi.json");

macro_rules! routes {
    ($($id:ident => [$($method:literal),+] $template:literal,)*) => {
        /// A route the gateway serves.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum Route {
            $($id,)*
        }

        impl Route {
            /// Every route, in table order.
            #[cfg_attr(not(test), expect(dead_code, reason = "the tests walk the table"))]
            pub(crate) const ALL: &'static [Route] = &[$(Route::$id,)*];

            /// The HTTP methods the route answers.
            #[cfg_attr(not(test), expect(dead_code, reason = "the tests walk the table"))]
            pub(crate) fn methods(self) -> &'static [&'static str] {
                match self {
                    $(Route::$id => &[$($method),+],)*
                }
            }

            /// The OpenAPI path template.
            #[cfg_attr(not(test), expect(dead_code, reason = "the tests walk the table"))]
            pub(crate) fn template(self) -> &'static str {
                match self {
                    $(Route::$id => $template,)*
                }
            }
        }
    };
}

routes! {
    Health => ["GET"] "/health",
    HealthWorkers => ["GET"] "/health/workers",
    Metrics => ["GET"] "/metrics",
    OpenApi => ["GET"] "/openapi.json",
    Docs => ["GET"] "/docs",
    CreateSession => ["POST"] "/sessions",
    ListSessions => ["GET"] "/sessions",
    BatchDelete => ["POST"] "/sessions/batch_delete",
    GetSession => ["GET"] "/sessions/{session_id}",
    DeleteSession => ["DELETE"] "/sessions/{session_id}",
    SessionTraces => ["GET"] "/sessions/{session_id}/traces",
    SealSession => ["POST"] "/sessions/{session_id}/seal",
    SessionReward => ["POST"] "/sessions/{session_id}/reward",
    SessionChat => ["POST"] "/sessions/{session_id}/v1/chat/completions",
    SessionCompletions => ["POST"] "/sessions/{session_id}/v1/completions",
    SessionProxy => ["GET", "POST"] "/sessions/{session_id}/v1/{path}",
    SessionProxyRoot => ["GET", "POST"] "/sessions/{session_id}/v1",
    Proxy => ["GET", "POST"] "/v1/{path}",
    ProxyRoot => ["GET", "POST"] "/v1",
    GetTrace => ["GET"] "/traces/{trace_id}",
    TraceReward => ["POST"] "/traces/{trace_id}/reward",
    QueryTraces => ["POST"] "/traces/query",
    Flush => ["POST"] "/admin/flush",
    Reload => ["POST"] "/admin/reload",
    GetWeightVersion => ["GET"] "/admin/weight_version",
    SetWeightVersion => ["POST"] "/admin/weight_version",
    ListWorkers => ["GET"] "/admin/workers",
    AddWorker => ["POST"] "/admin/workers",
    RemoveWorker => ["DELETE"] "/admin/workers/{worker_id}",
    Compact => ["POST"] "/admin/compact",
    Audit => ["GET"] "/admin/audit",
}

impl Route {
    /// Routes forwarded to a worker.
    pub(crate) fn is_proxy(self) -> bool {
        matches!(
            self,
            Route::SessionChat
                | Route::SessionCompletions
                | Route::SessionProxy
                | Route::SessionProxyRoot
                | Route::Proxy
                | Route::ProxyRoot
        )
    }
}

/// The parts of a matched path.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Params<'p> {
    pub session_id: Option<&'p str>,
    /// For proxy routes: the `/v1...` path forwarded.
    pub v1_path: Option<&'p str>,
    /// `{trace_id}` or `{worker_id}`.
    pub id: Option<&'p str>,
}

/// Why a request matched no route.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Miss {
    NotFound,
    MethodNotAllowed,
}

/// rLLM's `/sessions/(.+?)(/v1(?:/.*)?)$`: the shortest session id that leaves
/// a `/v1` or `/v1/...` tail.
pub(crate) fn split_session_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix("/sessions/")?;
    let mut from = 1;
    while from <= rest.len() {
        let i = from + rest.get(from..)?.find("/v1")?;
        let tail = &rest[i..];
        if tail.len() == 3 || tail.as_bytes().get(3) == Some(&b'/') {
            return Some((&rest[..i], tail));
        }
        from = i + 1;
    }
    None
}

/// The route of `method` on the (percent-decoded) `path`, in rLLM's order:
/// the session proxy first, then `/v1`, the fixed routes, and the
/// `/sessions/{session_id:path}...` routes (`.../traces` before the session).
pub(crate) fn classify<'p>(method: &str, path: &'p str) -> Result<(Route, Params<'p>), Miss> {
    let proxy_method = matches!(method, "GET" | "POST");
    if let Some((sid, tail)) = split_session_path(path) {
        if !proxy_method {
            return Err(Miss::MethodNotAllowed);
        }
        let route = match (method, tail) {
            ("POST", "/v1/chat/completions") => Route::SessionChat,
            ("POST", "/v1/completions") => Route::SessionCompletions,
            (_, "/v1") => Route::SessionProxyRoot,
            _ => Route::SessionProxy,
        };
        return Ok((route, Params { session_id: Some(sid), v1_path: Some(tail), id: None }));
    }
    if path == "/v1" || path.starts_with("/v1/") {
        if !proxy_method {
            return Err(Miss::MethodNotAllowed);
        }
        let route = if path == "/v1" { Route::ProxyRoot } else { Route::Proxy };
        return Ok((route, Params { v1_path: Some(path), ..Params::default() }));
    }
    let segs: Vec<&'p str> = path.trim_start_matches('/').split('/').collect();
    let fixed = match (method, segs.as_slice()) {
        ("GET", ["health"]) => Some((Route::Health, None)),
        ("GET", ["health", "workers"]) => Some((Route::HealthWorkers, None)),
        ("GET", ["metrics"]) => Some((Route::Metrics, None)),
        ("GET", ["openapi.json"]) => Some((Route::OpenApi, None)),
        ("GET", ["docs"]) => Some((Route::Docs, None)),
        ("POST", ["sessions"]) => Some((Route::CreateSession, None)),
        ("GET", ["sessions"]) => Some((Route::ListSessions, None)),
        ("POST", ["sessions", "batch_delete"]) => Some((Route::BatchDelete, None)),
        ("POST", ["traces", "query"]) => Some((Route::QueryTraces, None)),
        ("GET", ["traces", id]) => Some((Route::GetTrace, Some(*id))),
        ("POST", ["traces", id, "reward"]) => Some((Route::TraceReward, Some(*id))),
        ("POST", ["admin", "flush"]) => Some((Route::Flush, None)),
        ("POST", ["admin", "reload"]) => Some((Route::Reload, None)),
        ("GET", ["admin", "weight_version"]) => Some((Route::GetWeightVersion, None)),
        ("POST", ["admin", "weight_version"]) => Some((Route::SetWeightVersion, None)),
        ("GET", ["admin", "workers"]) => Some((Route::ListWorkers, None)),
        ("POST", ["admin", "workers"]) => Some((Route::AddWorker, None)),
        ("DELETE", ["admin", "workers", id]) => Some((Route::RemoveWorker, Some(*id))),
        ("POST", ["admin", "compact"]) => Some((Route::Compact, None)),
        ("GET", ["admin", "audit"]) => Some((Route::Audit, None)),
        _ => None,
    };
    if let Some((route, id)) = fixed {
        return Ok((route, Params { id, ..Params::default() }));
    }
    let Some(rest) = path.strip_prefix("/sessions/").filter(|r| !r.is_empty()) else { return Err(Miss::NotFound) };
    let session = |route: Route, sid: &'p str| Ok((route, Params { session_id: Some(sid), ..Params::default() }));
    let strip = |suffix: &str| rest.strip_suffix(suffix).filter(|s| !s.is_empty());
    match method {
        "GET" => match strip("/traces") {
            Some(sid) => session(Route::SessionTraces, sid),
            None => session(Route::GetSession, rest),
        },
        "DELETE" => session(Route::DeleteSession, rest),
        "POST" => match (strip("/seal"), strip("/reward")) {
            (Some(sid), _) => session(Route::SealSession, sid),
            (None, Some(sid)) => session(Route::SessionReward, sid),
            (None, None) => Err(Miss::MethodNotAllowed),
        },
        _ => Err(Miss::MethodNotAllowed),
    }
}

fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

/// `GET /docs`: a plain HTML listing of the OpenAPI document's routes, with
/// a link to the document (no script, nothing fetched from elsewhere).
pub(crate) fn docs_html() -> Result<String, String> {
    let doc: serde_json::Value =
        serde_json::from_str(OPENAPI_JSON).map_err(|e| format!("the OpenAPI document is not JSON: {e}"))?;
    let text = |v: &serde_json::Value| html_escape(v.as_str().unwrap_or(""));
    let mut rows = String::new();
    if let Some(paths) = doc["paths"].as_object() {
        for (path, item) in paths {
            for (method, op) in item.as_object().into_iter().flatten() {
                rows.push_str(&format!(
                    "<tr><td><code>{}</code></td><td><code>{}</code></td><td>{}</td></tr>\n",
                    html_escape(&method.to_ascii_uppercase()),
                    html_escape(path),
                    text(&op["summary"])
                ));
            }
        }
    }
    Ok(format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title} {version}</title></head>\n<body>\n\
         <h1>{title} {version}</h1>\n<p>{description}</p>\n\
         <p>The OpenAPI document: <a href=\"/openapi.json\">/openapi.json</a></p>\n\
         <table>\n<tr><th>method</th><th>path</th><th>what</th></tr>\n{rows}</table>\n</body></html>\n",
        title = text(&doc["info"]["title"]),
        version = text(&doc["info"]["version"]),
        description = text(&doc["info"]["description"]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A template with sample values, the session id one with `/` and `:`.
    fn fill(template: &str) -> String {
        template
            .replace("{session_id}", "harbor/hello-world:0")
            .replace("{path}", "models")
            .replace("{trace_id}", "t-1")
            .replace("{worker_id}", "w-1")
    }

    fn document() -> serde_json::Value {
        serde_json::from_str(OPENAPI_JSON).expect("openapi.json is JSON")
    }

    #[test]
    fn the_document_lists_exactly_the_routes_served() {
        let doc = document();
        assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "an OpenAPI 3 document");
        assert_eq!(doc["info"]["version"].as_str(), Some(env!("CARGO_PKG_VERSION")));
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("path item").keys() {
                documented.insert((method.to_ascii_uppercase(), path.clone()));
            }
        }
        let served: BTreeSet<(String, String)> = Route::ALL
            .iter()
            .flat_map(|r| r.methods().iter().map(move |m| ((*m).to_owned(), r.template().to_owned())))
            .collect();
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let not_served: Vec<_> = documented.difference(&served).collect();
        assert!(undocumented.is_empty(), "served but not in openapi.json: {undocumented:?}");
        assert!(not_served.is_empty(), "in openapi.json but not served: {not_served:?}");
    }

    #[test]
    fn each_template_classifies_to_its_route() {
        for r in Route::ALL {
            for m in r.methods() {
                let path = fill(r.template());
                assert_eq!(classify(m, &path).map(|(got, _)| got), Ok(*r), "{m} {path}");
            }
        }
    }

    #[test]
    fn path_parameters_are_declared() {
        let doc = document();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            let wanted: BTreeSet<&str> =
                path.split('{').skip(1).filter_map(|s| s.split_once('}').map(|(name, _)| name)).collect();
            for (method, op) in item.as_object().expect("path item") {
                let declared: BTreeSet<&str> = op["parameters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["in"] == "path")
                    .filter_map(|p| p["name"].as_str())
                    .collect();
                assert_eq!(declared, wanted, "{method} {path}");
                assert!(op["responses"].as_object().is_some_and(|r| !r.is_empty()), "{method} {path}: responses");
            }
        }
    }

    #[test]
    fn classify_keeps_rllms_rules() {
        let c = |m: &str, p: &'static str| classify(m, p);
        assert_eq!(
            c("POST", "/sessions/harbor/hello-world:0/v1/chat/completions"),
            Ok((
                Route::SessionChat,
                Params { session_id: Some("harbor/hello-world:0"), v1_path: Some("/v1/chat/completions"), id: None }
            ))
        );
        assert_eq!(c("GET", "/sessions/a/v1x/v1/models").map(|(_, p)| p.session_id), Ok(Some("a/v1x")));
        assert_eq!(
            c("GET", "/sessions/s/traces").map(|(r, p)| (r, p.session_id)),
            Ok((Route::SessionTraces, Some("s")))
        );
        assert_eq!(c("GET", "/sessions/batch_delete").map(|(r, _)| r), Ok(Route::GetSession));
        assert_eq!(c("PUT", "/v1/models"), Err(Miss::MethodNotAllowed));
        assert_eq!(c("PATCH", "/sessions/s"), Err(Miss::MethodNotAllowed));
        assert_eq!(c("GET", "/nope"), Err(Miss::NotFound));
        assert_eq!(c("GET", "/sessions/"), Err(Miss::NotFound));
        assert_eq!(c("DELETE", "/admin/workers/w").map(|(r, p)| (r, p.id)), Ok((Route::RemoveWorker, Some("w"))));
    }

    #[test]
    fn session_path_rule() {
        assert_eq!(
            split_session_path("/sessions/harbor/hello-world:0/v1/chat/completions"),
            Some(("harbor/hello-world:0", "/v1/chat/completions"))
        );
        assert_eq!(split_session_path("/sessions/s/v1"), Some(("s", "/v1")));
        assert_eq!(split_session_path("/sessions/a/v1x/v1/models"), Some(("a/v1x", "/v1/models")));
        assert_eq!(split_session_path("/sessions/s/traces"), None);
    }

    #[test]
    fn docs_page_lists_every_route_and_links_the_document() {
        let html = docs_html().expect("renders");
        assert!(html.contains("href=\"/openapi.json\""));
        assert!(!html.contains("<script"), "no script, no CDN");
        for r in Route::ALL {
            assert!(html.contains(&format!("<code>{}</code>", html_escape(r.template()))), "{}", r.template());
        }
    }
}
