//! Inference workers and session-sticky routing (contract §4.2–4.4).
//!
//! A session is pinned to the worker that served its first call (prefix-cache
//! affinity); a new session, or one whose worker is unhealthy or gone, goes to
//! the least-loaded healthy worker (ties: the first registered). A worker is
//! unhealthy after [`HEALTH_FAILURES_MAX`] failed health checks, or at once
//! when a connection to it fails; healthy again after a health check or a
//! call that succeeds. Any add or
//! remove clears the pins, as rLLM does. The pin map is bounded
//! ([`STICKY_SESSIONS_MAX`]); when full, it is cleared rather than grown.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Most session→worker pins kept.
pub const STICKY_SESSIONS_MAX: usize = 10_000;
/// Consecutive failed health checks that mark a worker unhealthy.
pub const HEALTH_FAILURES_MAX: u32 = 3;

/// One inference server.
#[derive(Debug)]
pub struct Worker {
    pub id: String,
    /// Base URL (health checks go to `{url}/health`).
    pub url: String,
    /// Prefix of the OpenAI API on the worker (`/v1`).
    pub api_path: String,
    pub model_name: Option<String>,
    pub weight: i64,
    pub healthy: AtomicBool,
    pub failures: AtomicU32,
    pub active: AtomicUsize,
}

impl Worker {
    /// The URL an agent path `/v1/<rest>` goes to: `{url}{api_path}/<rest>`.
    pub fn target(&self, v1_path: &str) -> String {
        let rest = v1_path.strip_prefix("/v1").unwrap_or(v1_path);
        format!("{}{}{}", self.url.trim_end_matches('/'), self.api_path.trim_end_matches('/'), rest)
    }

    /// rLLM's `WorkerInfo` (key order kept).
    pub fn info_json(&self) -> String {
        use crate::json::string;
        format!(
            "{{\"worker_id\":{},\"url\":{},\"api_path\":{},\"model_name\":{},\"weight\":{},\"healthy\":{},\"active_requests\":{}}}",
            string(&self.id),
            string(&self.url),
            string(&self.api_path),
            self.model_name.as_deref().map(string).unwrap_or_else(|| "null".into()),
            self.weight,
            self.healthy.load(Ordering::Relaxed),
            self.active.load(Ordering::Relaxed)
        )
    }
}

/// Split `http://h:8000/v1` into (`http://h:8000`, `/v1`); no path → `/v1`
/// (rLLM's `_split_worker_url`, used when no `api_path` is given).
pub fn split_url(url: &str) -> (String, String) {
    let url = url.trim_end_matches('/');
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    match url[after_scheme..].find('/') {
        Some(i) => {
            let cut = after_scheme + i;
            (url[..cut].to_owned(), url[cut..].to_owned())
        }
        None => (url.to_owned(), "/v1".to_owned()),
    }
}

/// An in-flight call on a worker; releases the worker's count when dropped,
/// whatever path the call ends on.
pub struct Lease {
    pub worker: Arc<Worker>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.worker.active.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| Some(n.saturating_sub(1)));
    }
}

/// The worker set and the session pins.
#[derive(Default)]
pub struct Router {
    workers: RwLock<Vec<Arc<Worker>>>,
    sticky: Mutex<HashMap<String, String>>,
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}
fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}
fn lock<T>(l: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    l.lock().unwrap_or_else(|e| e.into_inner())
}

impl Router {
    /// Register a worker; false (and nothing changes) when its URL is taken.
    pub fn add(&self, w: Worker) -> bool {
        let mut ws = write(&self.workers);
        if ws.iter().any(|o| o.url == w.url) {
            return false;
        }
        ws.push(Arc::new(w));
        lock(&self.sticky).clear();
        true
    }

    /// Remove a worker by id; whether it existed.
    pub fn remove(&self, id: &str) -> bool {
        let mut ws = write(&self.workers);
        let before = ws.len();
        ws.retain(|w| w.id != id);
        let removed = ws.len() != before;
        if removed {
            lock(&self.sticky).clear();
        }
        removed
    }

    pub fn list(&self) -> Vec<Arc<Worker>> {
        read(&self.workers).clone()
    }

    /// Pick a worker for a call (sticky for a session, else least loaded)
    /// and count it in flight. None when no healthy worker is registered.
    pub fn route(&self, session_id: Option<&str>) -> Option<Lease> {
        let ws = read(&self.workers);
        let healthy = || ws.iter().filter(|w| w.healthy.load(Ordering::Acquire));
        let pinned = session_id.and_then(|sid| {
            let url = lock(&self.sticky).get(sid).cloned()?;
            healthy().find(|w| w.url == url).cloned()
        });
        let worker = match pinned {
            Some(w) => w,
            None => {
                // min_by_key keeps the first of equal minima: ties go to the first registered.
                let w = healthy().min_by_key(|w| w.active.load(Ordering::Acquire))?.clone();
                if let Some(sid) = session_id {
                    let mut s = lock(&self.sticky);
                    if s.len() >= STICKY_SESSIONS_MAX {
                        s.clear();
                    }
                    s.insert(sid.to_owned(), w.url.clone());
                }
                w
            }
        };
        worker.active.fetch_add(1, Ordering::AcqRel);
        Some(Lease { worker })
    }

    /// Count another call in flight on `worker`, whatever its health (a
    /// connection retry that has no other worker to go to).
    pub fn lease(&self, worker: Arc<Worker>) -> Lease {
        worker.active.fetch_add(1, Ordering::AcqRel);
        Lease { worker }
    }

    /// A connection to `w` failed: unhealthy at once (no new session goes
    /// to it, pinned ones move) until a health check or a call succeeds.
    pub fn report_unreachable(&self, w: &Worker) {
        w.failures.store(HEALTH_FAILURES_MAX, Ordering::Release);
        w.healthy.store(false, Ordering::Release);
    }

    /// Record one health check result.
    pub fn report_health(&self, w: &Worker, ok: bool) {
        if ok {
            w.failures.store(0, Ordering::Release);
            w.healthy.store(true, Ordering::Release);
        } else if w.failures.fetch_add(1, Ordering::AcqRel) + 1 >= HEALTH_FAILURES_MAX {
            w.healthy.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: &str, url: &str) -> Worker {
        Worker {
            id: id.into(),
            url: url.into(),
            api_path: "/v1".into(),
            model_name: None,
            weight: 1,
            healthy: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            active: AtomicUsize::new(0),
        }
    }

    #[test]
    fn split_url_like_rllm() {
        assert_eq!(split_url("http://h:8000/v1"), ("http://h:8000".into(), "/v1".into()));
        assert_eq!(split_url("http://h:8000/"), ("http://h:8000".into(), "/v1".into()));
        assert_eq!(split_url("http://h/api/v2"), ("http://h".into(), "/api/v2".into()));
    }

    #[test]
    fn sticky_then_least_loaded() {
        let r = Router::default();
        assert!(r.add(worker("0", "http://a")));
        assert!(r.add(worker("1", "http://b")));
        assert!(!r.add(worker("2", "http://a")), "duplicate url ignored");
        let a = r.route(Some("s1")).map(|l| l.worker.url.clone());
        let held = r.route(Some("s1"));
        assert_eq!(held.as_ref().map(|l| l.worker.url.clone()), a, "session stays on its worker");
        // s1's worker is busy now: a new session goes to the other one.
        let b = r.route(Some("s2")).map(|l| l.worker.url.clone());
        assert_ne!(a, b);
        drop(held);
        let w = r.list()[0].clone();
        for _ in 0..HEALTH_FAILURES_MAX {
            r.report_health(&w, false);
        }
        assert!(r.route(Some("s1")).is_some_and(|l| l.worker.url == "http://b"));
        assert!(r.remove("1"));
        assert!(r.route(None).is_none(), "only an unhealthy worker left");
    }
}
