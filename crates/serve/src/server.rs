//! The HTTP side: one dispatcher over the routes of `routes.rs` (rLLM's
//! routes and its session-id rule, contract §1), the agent proxy (plain and streaming),
//! the training-side control API, and the bridge to the blocking store.

use crate::capture::{self, CallFacts, Injection, StreamAssembly};
use crate::config::UPSTREAM_RETRY_BACKOFF_MS;
use crate::json::{self, Obj};
use crate::metrics::Metrics;
use crate::routes::{self, Miss, Route};
use crate::store_slot::StoreSlot;
use crate::workers::{split_url, Lease, Router, Worker};
use crate::{Config, DurabilityMode};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use trajlog::{Durability, Options, Store, Target};

/// In-memory session state (rLLM keeps it in memory too, contract §4.1).
#[derive(Default)]
struct Session {
    created_at: f64,
    metadata: Option<String>,
    sampling_params: Option<Obj>,
}

struct App {
    config: Config,
    /// The store, emptied while it is reopened after a failed write
    /// poisoned it (`store_slot.rs`).
    store: StoreSlot,
    router: Router,
    client: reqwest::Client,
    sessions: Mutex<HashMap<String, Session>>,
    weight_version: Mutex<Option<i64>>,
    metrics: Metrics,
    health_started: AtomicBool,
    /// Set once the gateway stops serving: the background tasks (health
    /// checks, periodic compaction) return at their next wait.
    stop: tokio::sync::watch::Sender<bool>,
    /// The background tasks, awaited by the shutdown before it closes the
    /// store (a compaction under way holds the store: it is finished first).
    background: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Woken by the store's writer after each commit that makes appends
    /// durable (and when the store fails or closes): captures waiting for
    /// durability poll their receipts then, holding no thread.
    durable: Arc<tokio::sync::Notify>,
}

impl App {
    /// Run `task` in the background until the gateway stops: it is awaited
    /// by the shutdown, so it must watch `stop`.
    fn spawn_background(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        lock(&self.background).push(tokio::spawn(task));
    }
}

/// Resolves once `stop` is set (at once if it is already).
async fn stopped(mut stop: tokio::sync::watch::Receiver<bool>) {
    // An error means the sender is gone: the gateway is gone too.
    let _ = stop.wait_for(|s| *s).await;
}

/// Sleep `interval` unless the gateway stops first: whether to go on (not
/// once `stop` is set, even when both were ready).
async fn sleep_unless_stopped(interval: Duration, stop: &tokio::sync::watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(interval) => {}
        _ = stopped(stop.clone()) => return false,
    }
    !*stop.borrow()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// A running gateway.
pub struct Server {
    /// The bound address (the real port when 0 was asked).
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<Result<(), String>>,
}

impl Server {
    /// Stop accepting, drain in-flight calls, stop the background tasks (a
    /// periodic compaction under way is finished first), flush and close
    /// the store: once this returns, the store's directory is free for
    /// another writer.
    pub async fn shutdown(mut self) -> Result<(), String> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.wait().await
    }

    /// Wait until the server stops (after [`Server::shutdown`] or a fatal error).
    pub async fn wait(mut self) -> Result<(), String> {
        self.wait_ref().await
    }

    /// [`Server::wait`] without consuming the handle (cancel-safe: it can be
    /// raced against a signal and awaited again).
    pub async fn wait_ref(&mut self) -> Result<(), String> {
        (&mut self.done).await.map_err(|e| format!("server task failed: {e}"))?
    }

    /// A handle that triggers the graceful shutdown when sent to.
    pub fn shutdown_trigger(&mut self) -> Option<oneshot::Sender<()>> {
        self.shutdown.take()
    }
}

/// Open the store, bind, and serve until shut down.
pub async fn start(config: Config) -> Result<Server, String> {
    if config.store.as_os_str().is_empty() {
        return Err("store: a store directory is required (--store DIR)".into());
    }
    let store = open_store(&config).await?;
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .map_err(|e| format!("cannot listen on {}:{}: {e}", config.host, config.port))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let router = Router::default();
    for (i, w) in config.workers.iter().enumerate() {
        router.add(make_worker(
            w.url.clone(),
            w.worker_id.clone().filter(|id| !id.is_empty()).unwrap_or_else(|| i.to_string()),
            w.api_path.clone(),
            w.model_name.clone(),
            w.weight,
        ));
    }
    let durable = Arc::new(tokio::sync::Notify::new());
    wake_on_durable(&store, &durable);
    let app = Arc::new(App {
        config,
        store: StoreSlot::new(store),
        router,
        client,
        sessions: Mutex::new(HashMap::new()),
        weight_version: Mutex::new(None),
        metrics: Metrics::default(),
        health_started: AtomicBool::new(false),
        stop: tokio::sync::watch::Sender::new(false),
        background: Mutex::new(Vec::new()),
        durable,
    });
    if !app.router.list().is_empty() {
        start_health_checks(&app);
    }
    start_periodic_compaction(&app);
    let (tx, rx) = oneshot::channel::<()>();
    let service = axum::Router::new().fallback(dispatch).with_state(app.clone());
    let done = tokio::spawn(async move {
        let served = axum::serve(listener, service)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await
            .map_err(|e| format!("server error: {e}"));
        tracing::info!("draining done; stopping the background tasks");
        app.stop.send_replace(true);
        // A task started while these are awaited sees `stop` set at once.
        loop {
            let tasks = std::mem::take(&mut *lock(&app.background));
            if tasks.is_empty() {
                break;
            }
            for task in tasks {
                if let Err(e) = task.await {
                    tracing::warn!(error = %e, "a background task failed");
                }
            }
        }
        tracing::info!("flushing and closing the store");
        let store = app.store.take("the gateway is shutting down".into());
        let lost = app.store.take_loss();
        drop(app);
        let closed = tokio::task::spawn_blocking(move || match store.map(Arc::try_unwrap) {
            Some(Ok(store)) => store.close(),
            // Still held elsewhere (a request's task not yet dropped): flushed
            // now, closed when the last holder lets go.
            Some(Err(store)) => store.flush(),
            // A reopen after a failed write never succeeded: nothing is open.
            None => Ok(()),
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("final flush and close failed: {e}"))
        // As the first flush after it would (`--durability async`).
        .and_then(|()| lost.map_or(Ok(()), |why| Err(format!("the store is closed, but {}", loss_report(&why)))));
        served.and(closed)
    });
    tracing::info!(%addr, "trajlog serve listening");
    Ok(Server { addr, shutdown: Some(tx), done })
}

/// Open the store `config` names, with its options.
async fn open_store(config: &Config) -> Result<Store, String> {
    let dir = config.store.clone();
    let (queue, zero_ahead, segment) =
        (config.store_queue_bytes, config.store_zero_ahead_bytes, config.store_segment_bytes);
    tokio::task::spawn_blocking(move || {
        let mut opts = Options::default().durability(Durability::Group);
        if let Some(q) = queue {
            opts = opts.queue_bytes(q);
        }
        if let Some(z) = zero_ahead {
            opts = opts.zero_ahead_bytes(z);
        }
        if let Some(b) = segment {
            opts = opts.segment_bytes(b);
        }
        Store::open(&dir, opts)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("cannot open store {}: {e}", config.store.display()))
}

/// Wake `durable` after each commit of `store` that makes appends durable
/// (and when it fails or closes): captures waiting for durability poll then.
fn wake_on_durable(store: &Store, durable: &Arc<tokio::sync::Notify>) {
    let wake = durable.clone();
    store.on_durable(move || wake.notify_waiters());
}

/// After a write failed: when the failure poisoned `store`, reopen it in the
/// background (once; later calls while it runs do nothing, and so does a
/// call that held a store already replaced).
fn after_failed_write(app: &Arc<App>, store: &Arc<Store>) {
    let Some(why) = store.poisoned() else { return };
    if !app.store.claim_reopen() {
        return;
    }
    // Out of the slot now, before this call answers: every later call sees
    // the reopen (a 503 saying why), none the poisoned store.
    let why = why.to_string();
    if let Some(old) = app.store.take_failed(store, why.clone()) {
        tracing::error!(error = %why, "a failed write poisoned the store; closing and reopening it");
        if app.config.durability == DurabilityMode::Async {
            // Traces answered before they were durable may be gone: the
            // next flush, the trainer's barrier, says so.
            app.store.note_loss(why.clone());
        }
        start_reopen(app, old);
    }
}

/// With the poisoned store `old` out of the slot: close it once the
/// requests holding it let go (they fail fast: it refuses writes), and open
/// it again, with a growing pause (0.1 s doubling to 30 s) while opening fails,
/// say while the disk is still full. A shutdown meanwhile stops the
/// attempts; it closes whatever store the slot then holds.
fn start_reopen(app: &Arc<App>, mut old: Arc<Store>) {
    let weak = Arc::downgrade(app);
    let stop = app.stop.subscribe();
    app.spawn_background(async move {
        let Some(app) = weak.upgrade() else { return };
        loop {
            match Arc::try_unwrap(old) {
                Ok(store) => {
                    // Its error is the poisoning, already reported.
                    let _ = tokio::task::spawn_blocking(move || store.close()).await;
                    break;
                }
                Err(held) => {
                    if !sleep_unless_stopped(Duration::from_millis(10), &stop).await {
                        app.store.put(held);
                        return;
                    }
                    old = held;
                }
            }
        }
        let mut pause = Duration::from_millis(100);
        loop {
            match open_store(&app.config).await {
                Ok(store) => {
                    wake_on_durable(&store, &app.durable);
                    app.store.put(Arc::new(store));
                    app.store.reopens.fetch_add(1, Ordering::Relaxed);
                    tracing::info!("the store is reopened and takes writes again");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "reopening the store failed");
                    app.store.still_empty(e);
                    if app.store.is_empty() {
                        // Reads go on from a read-only open (it writes
                        // nothing, so a full disk does not stop it).
                        let dir = app.config.store.clone();
                        if let Ok(Ok(ro)) = tokio::task::spawn_blocking(move || Store::open_read_only(&dir)).await {
                            tracing::info!("serving reads from a read-only open of the store meanwhile");
                            app.store.put_read_only(Arc::new(ro));
                        }
                    }
                    if !sleep_unless_stopped(pause, &stop).await {
                        return;
                    }
                    pause = (pause * 2).min(Duration::from_secs(30));
                }
            }
        }
    });
}

fn make_worker(
    url: String,
    id: String,
    api_path: Option<String>,
    model_name: Option<String>,
    weight: Option<i64>,
) -> Worker {
    let (url, api_path) = match api_path {
        Some(p) => (url, p),
        None => split_url(&url),
    };
    Worker {
        id,
        url,
        api_path,
        model_name,
        weight: weight.unwrap_or(1),
        healthy: AtomicBool::new(true),
        failures: AtomicU32::new(0),
        active: AtomicUsize::new(0),
    }
}

fn start_health_checks(app: &Arc<App>) {
    if app.health_started.swap(true, Ordering::AcqRel) {
        return;
    }
    let weak = Arc::downgrade(app);
    let interval = Duration::from_secs_f64(app.config.health_check_interval_s.clamp(0.05, 86_400.0));
    let stop = app.stop.subscribe();
    app.spawn_background(async move {
        while sleep_unless_stopped(interval, &stop).await {
            let Some(app) = weak.upgrade() else { return };
            for w in app.router.list() {
                let url = format!("{}/health", w.url.trim_end_matches('/'));
                let ok = tokio::select! {
                    r = app.client.get(&url).timeout(Duration::from_secs(5)).send() => {
                        matches!(r, Ok(r) if r.status() == StatusCode::OK)
                    }
                    _ = stopped(stop.clone()) => return,
                };
                if !ok {
                    tracing::warn!(worker = %w.url, "health check failed");
                }
                app.router.report_health(&w, ok);
            }
        }
    });
}

// ---------------------------------------------------------------- responses

fn json_response(status: StatusCode, body: String) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn ok_json(body: String) -> Response {
    json_response(StatusCode::OK, body)
}

fn error(status: StatusCode, msg: impl AsRef<str>) -> Response {
    json_response(status, format!("{{\"error\":{}}}", json::string(msg.as_ref())))
}

fn not_found() -> Response {
    json_response(StatusCode::NOT_FOUND, "{\"detail\":\"Not Found\"}".into())
}

fn unprocessable(field: &str, msg: &str) -> Response {
    json_response(
        StatusCode::UNPROCESSABLE_ENTITY,
        format!("{{\"detail\":[{{\"loc\":[\"query\",{}],\"msg\":{}}}]}}", json::string(field), json::string(msg)),
    )
}

// ---------------------------------------------------------------- dispatch

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
            if let Some(v) = hex {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_params(q: Option<&str>) -> Vec<(String, String)> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(&k.replace('+', " ")), percent_decode(&v.replace('+', " ")))
        })
        .collect()
}

struct Window {
    since: Option<f64>,
    limit: Option<usize>,
}

#[allow(clippy::result_large_err, reason = "the error is the response to send; it is built once per request")]
fn window(q: &[(String, String)]) -> Result<Window, Response> {
    let mut w = Window { since: None, limit: None };
    for (k, v) in q {
        match k.as_str() {
            "since" => {
                w.since = Some(
                    v.parse::<f64>()
                        .ok()
                        .filter(|x| x.is_finite())
                        .ok_or_else(|| unprocessable("since", "must be a number (epoch seconds)"))?,
                )
            }
            "limit" => {
                w.limit =
                    Some(v.parse::<usize>().map_err(|_| unprocessable("limit", "must be a non-negative integer"))?)
            }
            _ => {}
        }
    }
    Ok(w)
}

async fn dispatch(State(app): State<Arc<App>>, req: Request) -> Response {
    let path = percent_decode(req.uri().path());
    let (route, params) = match routes::classify(req.method().as_str(), &path) {
        Ok(m) => m,
        Err(Miss::NotFound) => return not_found(),
        Err(Miss::MethodNotAllowed) => {
            return json_response(StatusCode::METHOD_NOT_ALLOWED, "{\"detail\":\"Method Not Allowed\"}".into())
        }
    };
    let query = req.uri().query().map(str::to_owned);
    if route.is_proxy() {
        let sid = params.session_id.map(str::to_owned);
        let v1_path = params.v1_path.unwrap_or("/v1").to_owned();
        return proxy(app, sid, v1_path, query, req).await;
    }
    let q = query_params(query.as_deref());
    let body = match axum::body::to_bytes(req.into_body(), app.config.request_bytes_max).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e}")),
    };
    let sid = params.session_id.unwrap_or("");
    let id = params.id.unwrap_or("");
    match route {
        // Forwarded above, before the body is read.
        Route::SessionChat
        | Route::SessionCompletions
        | Route::SessionProxy
        | Route::SessionProxyRoot
        | Route::Proxy
        | Route::ProxyRoot => not_found(),
        Route::Health => {
            // A store poisoned by a write nobody waited on (an async
            // capture) is found here too, and its reopen started.
            if let Ok(store) = app.store.get_writable() {
                after_failed_write(&app, &store);
            }
            match app.store.available() {
                Ok(()) => ok_json("{\"status\":\"ok\"}".into()),
                Err(why) => json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("{{\"status\":\"unavailable\",\"store\":{}}}", json::string(&why)),
                ),
            }
        }
        Route::HealthWorkers => {
            let ws = app.router.list();
            let healthy = ws.iter().filter(|w| w.healthy.load(Ordering::Relaxed)).count();
            let items =
                json::join_list(ws.iter().map(|w| w.info_json()).collect::<Vec<_>>().iter().map(String::as_str));
            ok_json(format!("{{\"workers\":{items},\"healthy\":{healthy},\"total\":{}}}", ws.len()))
        }
        Route::Metrics => {
            let mut text = app.metrics.render();
            text.push_str(&crate::metrics::store_lines(
                app.store.available().is_ok(),
                app.store.reopens.load(Ordering::Relaxed),
            ));
            let mut r = Response::new(Body::from(text));
            r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
            r
        }
        Route::OpenApi => ok_json(routes::OPENAPI_JSON.to_owned()),
        Route::Docs => match routes::docs_html() {
            Ok(html) => {
                let mut r = Response::new(Body::from(html));
                r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
                r
            }
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
        },
        Route::CreateSession => create_session(&app, &body),
        Route::ListSessions => match window(&q) {
            Ok(w) => list_sessions(&app, w).await,
            Err(r) => r,
        },
        Route::BatchDelete => batch_delete(&app, &body).await,
        Route::GetSession => get_session(&app, sid).await,
        Route::DeleteSession => match delete_sessions(&app, vec![sid.to_owned()]).await {
            Ok(n) => ok_json(format!("{{\"deleted\":{n}}}")),
            Err(r) => r,
        },
        Route::SessionTraces => match window(&q) {
            Ok(w) => session_traces(&app, sid, w).await,
            Err(r) => r,
        },
        Route::SealSession => {
            let store = match app.store.get_writable() {
                Ok(s) => s,
                Err(e) => return store_error(e),
            };
            let (held, sid2) = (store.clone(), sid.to_owned());
            match blocking(move || held.seal_session(&sid2)).await {
                Ok(()) => ok_json(format!("{{\"sealed\":{}}}", json::string(sid))),
                Err(e) => {
                    after_failed_write(&app, &store);
                    store_error(e)
                }
            }
        }
        Route::SessionReward => set_reward(&app, Target::Session(sid.to_owned()), &body).await,
        Route::QueryTraces => query_traces(&app, &body).await,
        Route::GetTrace => get_trace(&app, id).await,
        Route::TraceReward => set_reward(&app, Target::Trace(id.to_owned()), &body).await,
        Route::Flush => flush(&app).await,
        Route::Reload => ok_json("{\"status\":\"ok\"}".into()),
        Route::GetWeightVersion => {
            let wv = *lock(&app.weight_version);
            ok_json(format!("{{\"weight_version\":{}}}", wv.map(|w| w.to_string()).unwrap_or_else(|| "null".into())))
        }
        Route::SetWeightVersion => set_weight_version(&app, &body),
        Route::ListWorkers => ok_json(json::join_list(
            app.router.list().iter().map(|w| w.info_json()).collect::<Vec<_>>().iter().map(String::as_str),
        )),
        Route::AddWorker => add_worker(&app, &body),
        Route::RemoveWorker => {
            if app.router.remove(id) {
                ok_json(format!("{{\"removed\":{}}}", json::string(id)))
            } else {
                error(StatusCode::NOT_FOUND, format!("Worker {id} not found"))
            }
        }
        Route::Compact => compact(&app).await,
        Route::Audit => audit(&app).await,
    }
}

// ---------------------------------------------------------------- the store bridge

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> trajlog::Result<T> + Send + 'static) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("store task failed: {e}")),
    }
}

fn store_error(e: String) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}"))
}

/// Hand a trace record to the store; with `Sync` durability, wait until it
/// is durable (concurrent waits share one group commit). The record is
/// appended on this task when the writer's queue has room (no thread hop),
/// and the wait holds no thread: the writer wakes `app.durable` after each
/// commit. A full queue waits for room on a blocking thread (back-pressure).
async fn capture(app: &Arc<App>, call: trajlog::Result<trajlog::ValidCall>) -> Result<(), String> {
    let sync = app.config.durability == DurabilityMode::Sync;
    app.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    let r = async {
        let call = call.map_err(|e| e.to_string())?;
        let store = app.store.get_writable()?;
        let written = async {
            let receipt = match store.try_append_valid(call) {
                Ok(trajlog::TryAppend::Appended(receipt)) => receipt,
                Ok(trajlog::TryAppend::Full(call)) => {
                    let held = store.clone();
                    blocking(move || held.append_valid(*call)).await?
                }
                Err(e) => return Err(e.to_string()),
            };
            if sync {
                durable(&app.durable, &receipt).await.map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        .await;
        if written.is_err() {
            after_failed_write(app, &store);
        }
        written
    }
    .await;
    app.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
    match &r {
        Ok(()) => app.metrics.traces_stored.fetch_add(1, Ordering::Relaxed),
        Err(e) => {
            tracing::error!(error = %e, "trace not stored");
            app.metrics.traces_failed.fetch_add(1, Ordering::Relaxed)
        }
    };
    r
}

/// Wait, holding no thread, until `receipt` is durable (or never will be).
async fn durable(wake: &tokio::sync::Notify, receipt: &trajlog::Receipt) -> trajlog::Result<()> {
    receipt.sync_soon();
    loop {
        // Registered before the poll, so a commit between the two still wakes it.
        let woken = wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if receipt.poll()? {
            return Ok(());
        }
        woken.await;
    }
}

/// A stored call as the gateway's JSON: [`trajlog::trace_json::export_call`]
/// (column logprobs as Python writes the widened `f64` it holds, values that
/// were not `f32`s verbatim) with the keys in rLLM's order (others after,
/// sorted), written in one pass.
fn trace_json(call: &trajlog::Call) -> String {
    trajlog::trace_json::export_call_gateway_order(call)
}

async fn get_trace(app: &Arc<App>, id: &str) -> Response {
    let store = match app.store.get() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let tid = id.to_owned();
    let r = blocking(move || {
        let snap = store.snapshot();
        Ok(match snap.get(&tid)? {
            Some(v) => Some(trace_json(&v.to_call()?)),
            None => None,
        })
    })
    .await;
    match r {
        Ok(Some(t)) => ok_json(t),
        Ok(None) => error(StatusCode::NOT_FOUND, format!("Trace {id} not found")),
        Err(e) => store_error(e),
    }
}

/// Traces of one session, oldest first; `since` inclusive as in rLLM.
fn traces_of(snap: &trajlog::Snapshot, sid: &str, w: &Window) -> trajlog::Result<Vec<String>> {
    // trajlog's `since` is exclusive; rLLM's is inclusive.
    let since = w.since.map(f64::next_down);
    Ok(snap.session_calls(sid, since, w.limit)?.iter().map(trace_json).collect())
}

async fn session_traces(app: &Arc<App>, sid: &str, w: Window) -> Response {
    let store = match app.store.get() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let sid = sid.to_owned();
    match blocking(move || traces_of(&store.snapshot(), &sid, &w)).await {
        Ok(list) => ok_json(json::join_list(list.iter().map(String::as_str))),
        Err(e) => store_error(e),
    }
}

async fn query_traces(app: &Arc<App>, body: &Bytes) -> Response {
    let req = Obj::parse_bytes(body).unwrap_or_default();
    let sids: Vec<String> = match req.get_some("session_ids").map(|v| serde_json::from_str(v.get())) {
        None => Vec::new(),
        Some(Ok(l)) => l,
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "session_ids: must be a list of strings"),
    };
    let since = match req.get_some("since").map(|v| v.get().parse::<f64>()) {
        None => None,
        Some(Ok(x)) => Some(x),
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "since: must be a number"),
    };
    let limit = match req.get_some("limit").map(|v| v.get().parse::<usize>()) {
        None => None,
        Some(Ok(x)) => Some(x),
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "limit: must be a non-negative integer"),
    };
    let store = match app.store.get() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let r = blocking(move || {
        let mut snap = store.snapshot();
        snap.decode_whole_row_groups();
        let mut all = Vec::new();
        for sid in &sids {
            // A query over many compacted sessions: what was decoded for the
            // earlier ones is dropped as it piles up.
            snap.bound_decoded(trajlog::limits::SCAN_DECODED_BYTES_MAX);
            all.extend(traces_of(&snap, sid, &Window { since, limit })?);
        }
        Ok(all)
    })
    .await;
    match r {
        Ok(list) => ok_json(json::join_list(list.iter().map(String::as_str))),
        Err(e) => store_error(e),
    }
}

fn session_info_json(sid: &str, count: usize, created_at: Option<f64>, metadata: Option<&str>) -> String {
    format!(
        "{{\"session_id\":{},\"trace_count\":{count},\"created_at\":{},\"metadata\":{}}}",
        json::string(sid),
        created_at.filter(|c| c.is_finite()).map(|c| format!("{c:?}")).unwrap_or_else(|| "null".into()),
        metadata.unwrap_or("{}")
    )
}

fn create_session(app: &Arc<App>, body: &Bytes) -> Response {
    // rLLM's `_safe_json`: a missing or invalid body is `{}`.
    let req = Obj::parse_bytes(body).unwrap_or_default();
    let sid = match req.get("session_id").map(|v| serde_json::from_str::<Option<String>>(v.get())) {
        None | Some(Ok(None)) => None,
        Some(Ok(Some(s))) => Some(s).filter(|s| !s.is_empty()),
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "session_id: must be a string"),
    };
    let sid = sid.unwrap_or_else(new_id);
    let metadata = req.get("metadata").filter(|v| json::truthy(v));
    if metadata.is_some_and(|m| !m.get().starts_with('{')) {
        return error(StatusCode::BAD_REQUEST, "metadata: must be an object");
    }
    let sampling = match req.get("sampling_params").filter(|v| json::truthy(v)) {
        None => None,
        Some(v) => match Obj::parse(v.get()) {
            Some(o) => Some(o),
            None => return error(StatusCode::BAD_REQUEST, "sampling_params: must be an object"),
        },
    };
    let mut sessions = lock(&app.sessions);
    let s = sessions.entry(sid.clone()).or_default();
    s.created_at = now();
    if let Some(m) = metadata {
        s.metadata = Some(m.get().to_owned());
    }
    if let Some(sp) = sampling {
        s.sampling_params = Some(sp);
    }
    ok_json(format!(
        "{{\"session_id\":{},\"url\":{}}}",
        json::string(&sid),
        json::string(&format!("/sessions/{sid}/v1"))
    ))
}

fn new_id() -> String {
    // A random v4 UUID from the OS-seeded std hasher state plus a counter.
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut words = [0u64; 2];
    for (i, w) in words.iter_mut().enumerate() {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_usize(i);
        h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
        *w = h.finish();
    }
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&words[0].to_le_bytes());
    b[8..].copy_from_slice(&words[1].to_le_bytes());
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

async fn get_session(app: &Arc<App>, sid: &str) -> Response {
    let store = match app.store.get() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let sid2 = sid.to_owned();
    let count = match blocking(move || Ok(store.snapshot().session_info(&sid2).map(|i| i.calls).unwrap_or(0))).await {
        Ok(c) => c,
        Err(e) => return store_error(e),
    };
    let sessions = lock(&app.sessions);
    let s = sessions.get(sid);
    if count == 0 && s.is_none() {
        return error(StatusCode::NOT_FOUND, format!("Session {sid} not found"));
    }
    ok_json(session_info_json(sid, count, s.map(|s| s.created_at), s.and_then(|s| s.metadata.as_deref())))
}

async fn list_sessions(app: &Arc<App>, w: Window) -> Response {
    let store = match app.store.get() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let mut infos = match blocking(move || Ok(store.snapshot().sessions())).await {
        Ok(i) => i,
        Err(e) => return store_error(e),
    };
    // Newest first by first trace; `since` drops sessions whose first trace is older.
    infos.reverse();
    if let Some(since) = w.since {
        infos.retain(|i| i.first_timestamp >= since);
    }
    infos.truncate(w.limit.unwrap_or(usize::MAX));
    let sessions = lock(&app.sessions);
    let items: Vec<String> = infos
        .iter()
        .map(|i| {
            let s = sessions.get(&i.session_id);
            session_info_json(
                &i.session_id,
                i.calls,
                Some(s.map(|s| s.created_at).unwrap_or(i.first_timestamp)),
                s.and_then(|s| s.metadata.as_deref()),
            )
        })
        .collect();
    ok_json(json::join_list(items.iter().map(String::as_str)))
}

#[allow(clippy::result_large_err, reason = "the error is the response to send; it is built once per request")]
async fn delete_sessions(app: &Arc<App>, sids: Vec<String>) -> Result<u64, Response> {
    {
        let mut sessions = lock(&app.sessions);
        for sid in &sids {
            sessions.remove(sid);
        }
    }
    let store = app.store.get_writable().map_err(store_error)?;
    let held = store.clone();
    blocking(move || {
        let mut n = 0;
        for sid in &sids {
            n += held.delete_session(sid)?;
        }
        Ok(n)
    })
    .await
    .map_err(|e| {
        after_failed_write(app, &store);
        store_error(e)
    })
}

async fn batch_delete(app: &Arc<App>, body: &Bytes) -> Response {
    let req = Obj::parse_bytes(body).unwrap_or_default();
    let sids: Vec<String> = match req.get_some("session_ids").map(|v| serde_json::from_str(v.get())) {
        None => Vec::new(),
        Some(Ok(l)) => l,
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "session_ids: must be a list of strings"),
    };
    match delete_sessions(app, sids).await {
        Ok(n) => ok_json(format!("{{\"deleted\":{n}}}")),
        Err(r) => r,
    }
}

async fn flush(app: &Arc<App>) -> Response {
    let flushed = match app.store.get_writable() {
        Err(e) => Err(e),
        Ok(store) => {
            let held = store.clone();
            blocking(move || held.flush()).await.map_err(|e| {
                after_failed_write(app, &store);
                e.to_string()
            })
        }
    };
    // The barrier cannot hold for what a failed write lost before the store
    // was reopened (`--durability async` answers before the trace is
    // durable): the first flush after the failure says so, once, so that
    // the trainer does not take those traces for stored.
    let lost = app.store.take_loss();
    match (flushed, lost) {
        (Ok(()), None) => ok_json("{\"status\":\"flushed\"}".into()),
        (Ok(()), Some(why)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "flush failed: {}. The store was reopened and takes traces again; the next flush covers what is \
                 captured from now on",
                loss_report(&why)
            ),
        ),
        (Err(e), lost) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("flush failed: {e}{}", lost.map(|why| format!("; {}", loss_report(&why))).unwrap_or_default()),
        ),
    }
}

/// What a failed write since the last flush (`why`) means for the traces
/// `--durability async` answered before it.
fn loss_report(why: &str) -> String {
    format!(
        "a write failed since the last flush ({why}): traces answered before it and not yet durable may have been lost"
    )
}

/// Python's `int(x)` for a JSON value: ints, integral-or-not floats
/// (truncated), booleans, and strings holding an integer.
fn python_int(v: &serde_json::value::RawValue) -> Option<i64> {
    let t = v.get();
    match t {
        "true" => return Some(1),
        "false" => return Some(0),
        _ => {}
    }
    if let Ok(i) = t.parse::<i64>() {
        return Some(i);
    }
    if t.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        return t.parse::<f64>().ok().filter(|f| f.is_finite() && f.abs() < 9.2e18).map(|f| f.trunc() as i64);
    }
    let s: String = serde_json::from_str(t).ok()?;
    s.trim().replace('_', "").parse::<i64>().ok()
}

fn set_weight_version(app: &Arc<App>, body: &Bytes) -> Response {
    let req = Obj::parse_bytes(body).unwrap_or_default();
    let Some(v) = req.get_some("weight_version") else {
        return error(StatusCode::BAD_REQUEST, "weight_version is required");
    };
    match python_int(v) {
        Some(w) => {
            *lock(&app.weight_version) = Some(w);
            ok_json(format!("{{\"weight_version\":{w}}}"))
        }
        None => error(StatusCode::BAD_REQUEST, format!("invalid weight_version: {}", v.get())),
    }
}

fn add_worker(app: &Arc<App>, body: &Bytes) -> Response {
    let req = Obj::parse_bytes(body).unwrap_or_default();
    let s = |k: &str| req.get_some(k).and_then(|v| serde_json::from_str::<String>(v.get()).ok());
    let Some(url) = s("url").filter(|u| !u.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "url is required");
    };
    let weight = req.get_some("weight").and_then(|v| v.get().parse::<i64>().ok());
    let w = make_worker(url, s("worker_id").unwrap_or_else(new_id), s("api_path"), s("model_name"), weight);
    let reply = format!(
        "{{\"worker_id\":{},\"url\":{},\"api_path\":{}}}",
        json::string(&w.id),
        json::string(&w.url),
        json::string(&w.api_path)
    );
    app.router.add(w);
    start_health_checks(app);
    ok_json(reply)
}

async fn set_reward(app: &Arc<App>, target: Target, body: &Bytes) -> Response {
    let req = Obj::parse_bytes(body).unwrap_or_default();
    let Some(value) = req.get_some("reward").and_then(|v| v.get().parse::<f64>().ok()).filter(|v| v.is_finite()) else {
        return error(StatusCode::BAD_REQUEST, "reward: a finite number is required");
    };
    let store = match app.store.get_writable() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let (held, t) = (store.clone(), target.clone());
    // A trace id with no live call is the caller's mistake (404), not the store's.
    let set = blocking(move || match held.set_reward(t, value) {
        Err(e) if matches!(e.kind(), trajlog::ErrorKind::NotFound) => Ok(Err(e.to_string())),
        r => r.map(Ok),
    });
    match set.await {
        Ok(Err(missing)) => error(StatusCode::NOT_FOUND, missing),
        Ok(Ok(())) => {
            let (kind, id) = match &target {
                Target::Trace(id) => ("trace_id", id),
                Target::Session(id) => ("session_id", id),
            };
            ok_json(format!("{{{}:{},\"reward\":{value:?}}}", json::string(kind), json::string(id)))
        }
        Err(e) => {
            after_failed_write(app, &store);
            store_error(e)
        }
    }
}

/// Compact the store (one compaction at a time: the store's own lock), with
/// the selection the configuration names, and count it in the metrics.
async fn run_compaction(app: &Arc<App>) -> Result<trajlog::CompactReport, String> {
    let store = app.store.get_writable()?;
    let selection = match app.config.compact_older_than_s {
        Some(s) => trajlog::Selection::OlderThan(s),
        None => trajlog::Selection::SealedOnly,
    };
    let held = store.clone();
    let result = blocking(move || held.compact(&trajlog::CompactOptions::default().selection(selection))).await;
    if result.is_err() {
        after_failed_write(app, &store);
    }
    match &result {
        Ok(r) => {
            app.metrics.compactions_ok.fetch_add(1, Ordering::Relaxed);
            app.metrics.compacted_calls.fetch_add(r.calls, Ordering::Relaxed);
        }
        Err(_) => {
            app.metrics.compactions_failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    result
}

/// `compact_every_s`: compact in the background at that interval (from the
/// end of one compaction to the start of the next) while the gateway runs;
/// a shutdown waits for a compaction under way and starts none.
fn start_periodic_compaction(app: &Arc<App>) {
    let Some(every) = app.config.compact_every_s else { return };
    let weak = Arc::downgrade(app);
    let interval = Duration::from_secs_f64(every.clamp(0.05, 86_400.0 * 365.0));
    let stop = app.stop.subscribe();
    app.spawn_background(async move {
        // None starts once the gateway stops.
        while sleep_unless_stopped(interval, &stop).await {
            let Some(app) = weak.upgrade() else { return };
            match run_compaction(&app).await {
                Ok(r) if r.calls > 0 || r.retired_segments > 0 || r.moved_calls > 0 => tracing::info!(
                    sessions = r.sessions,
                    calls = r.calls,
                    shards = r.shards.len(),
                    retired_segments = r.retired_segments,
                    elapsed_ms = r.elapsed.as_millis() as u64,
                    "periodic compaction"
                ),
                Ok(_) => tracing::debug!("periodic compaction: nothing to compact"),
                Err(e) => tracing::warn!(error = %e, "periodic compaction failed; trying again at the next interval"),
            }
        }
    });
}

async fn compact(app: &Arc<App>) -> Response {
    match run_compaction(app).await {
        Ok(r) => ok_json(format!(
            "{{\"sessions\":{},\"calls\":{},\"shards\":{},\"shard_bytes\":{},\"retired_segments\":{}}}",
            r.sessions,
            r.calls,
            r.shards.len(),
            r.shard_bytes,
            r.retired_segments
        )),
        Err(e) => store_error(e),
    }
}

async fn audit(app: &Arc<App>) -> Response {
    let store = match app.store.get() {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    match blocking(move || trajlog::audit::audit(&store.snapshot())).await {
        Ok(r) => match serde_json::to_string(&r) {
            Ok(t) => ok_json(t),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        },
        Err(e) => store_error(e),
    }
}

// ---------------------------------------------------------------- the proxy

/// Headers not forwarded: rLLM's hop-by-hop and body-framing list, plus
/// `accept-encoding` (the gateway reads the upstream body to capture it and
/// its client does not decompress, so the upstream must answer uncompressed).
const SKIP_HEADERS: &[&str] = &[
    "accept-encoding",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "content-encoding",
    "host",
];

fn forward_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (k, v) in h {
        if !SKIP_HEADERS.contains(&k.as_str()) {
            out.append(k.clone(), v.clone());
        }
    }
    out
}

enum Upstream {
    Failed(String),
    TimedOut,
}

impl Upstream {
    fn response(self, app: &App) -> Response {
        app.metrics.calls_upstream_failed.fetch_add(1, Ordering::Relaxed);
        match &self {
            Upstream::Failed(e) => tracing::warn!(error = %e, "upstream request failed"),
            Upstream::TimedOut => tracing::warn!("upstream timed out"),
        }
        match self {
            Upstream::Failed(e) => error(StatusCode::BAD_GATEWAY, format!("upstream request failed: {e}")),
            Upstream::TimedOut => error(StatusCode::GATEWAY_TIMEOUT, "upstream timed out"),
        }
    }
}

async fn with_timeout<T>(t: Option<Duration>, f: impl std::future::Future<Output = T>) -> Option<T> {
    match t {
        Some(d) => tokio::time::timeout(d, f).await.ok(),
        None => Some(f.await),
    }
}

async fn proxy(app: Arc<App>, sid: Option<String>, v1_path: String, query: Option<String>, req: Request) -> Response {
    let t0 = Instant::now();
    let dispatch_wv = *lock(&app.weight_version);
    let method = req.method().clone();
    let headers = forward_headers(req.headers());
    let body = match axum::body::to_bytes(req.into_body(), app.config.request_bytes_max).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e}")),
    };
    if let Some(sid) = &sid {
        lock(&app.sessions).entry(sid.clone()).or_insert_with(|| Session { created_at: now(), ..Default::default() });
    }
    // Only POST bodies that are JSON objects are touched; anything else is forwarded byte for byte.
    let prepared = if method == Method::POST {
        Obj::parse_bytes(&body).map(|o| {
            let sp = sid.as_ref().and_then(|s| lock(&app.sessions).get(s).and_then(|s| s.sampling_params.clone()));
            capture::prepare(
                o,
                &Injection {
                    add_logprobs: app.config.add_logprobs,
                    add_return_token_ids: app.config.add_return_token_ids,
                    model: app.config.model.as_deref(),
                    sampling_params: sp.as_ref(),
                },
            )
        })
    } else {
        None
    };
    // A call whose trace could not be stored now (the store is being
    // reopened after a failed write) is not sent upstream: its generation
    // would be thrown away, and the agent would get this 503 after it.
    if let (Some(_), Some(_), Err(why)) = (&sid, &prepared, app.store.get_writable()) {
        app.metrics.calls_store_unavailable.fetch_add(1, Ordering::Relaxed);
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, format!("not forwarded: {why}"));
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    }
    let forward_body: Bytes = match &prepared {
        Some(p) => Bytes::from(p.raw.get().to_owned()),
        None => body,
    };
    let Some(mut lease) = app.router.route(sid.as_deref()) else {
        app.metrics.calls_no_worker.fetch_add(1, Ordering::Relaxed);
        return error(StatusCode::SERVICE_UNAVAILABLE, "no healthy workers available");
    };
    app.metrics.request_bytes.fetch_add(forward_body.len() as u64, Ordering::Relaxed);
    let timeout = app.config.upstream_timeout();
    let mut headers = headers;
    if prepared.is_some() {
        // The body forwarded is JSON the gateway wrote (replaces the agent's header, never duplicates it).
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    let mut retries = 0;
    let resp = loop {
        let mut url = lease.worker.target(&v1_path);
        if let Some(q) = &query {
            url.push('?');
            url.push_str(q);
        }
        let send = app.client.request(method.clone(), &url).headers(headers.clone()).body(forward_body.clone()).send();
        match with_timeout(timeout, send).await {
            // A timeout may have come after the request was sent: never retried.
            None => return Upstream::TimedOut.response(&app),
            Some(Ok(r)) => {
                if retries > 0 && !lease.worker.healthy.load(Ordering::Acquire) {
                    app.router.report_health(&lease.worker, true);
                }
                break r;
            }
            // Connecting failed, so no byte of the request left: sending it
            // again cannot duplicate a generation. Any other error may come
            // after the upstream got the request, and is never retried.
            Some(Err(e)) if e.is_connect() => {
                app.router.report_unreachable(&lease.worker);
                tracing::warn!(worker = %lease.worker.url, error = %e, "cannot connect to the worker; marked unhealthy");
                if retries >= app.config.upstream_connect_retries {
                    return Upstream::Failed(e.to_string()).response(&app);
                }
                retries += 1;
                app.metrics.upstream_connect_retries.fetch_add(1, Ordering::Relaxed);
                let failed = lease.worker.clone();
                drop(lease);
                lease = match app.router.route(sid.as_deref()) {
                    Some(other) => other,
                    None => {
                        // No healthy worker left: the same one again, after a pause.
                        tokio::time::sleep(Duration::from_millis(UPSTREAM_RETRY_BACKOFF_MS * u64::from(retries))).await;
                        app.router.lease(failed)
                    }
                };
            }
            Some(Err(e)) => return Upstream::Failed(e.to_string()).response(&app),
        }
    };
    let stream = prepared.as_ref().is_some_and(|p| p.stream);
    if stream && resp.status().is_success() {
        return stream_response(app, sid, prepared, resp, lease, dispatch_wv);
    }
    if stream {
        // An upstream error on a stream: pass it through as it came, record nothing.
        app.metrics.calls_upstream_status_error.fetch_add(1, Ordering::Relaxed);
        return passthrough(resp, lease);
    }
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let bytes = match read_body(&app, resp, timeout).await {
        Ok(b) => b,
        Err(u) => return u.response(&app),
    };
    drop(lease);
    app.metrics.response_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    let latency_ms = t0.elapsed().as_secs_f64() * 1000.0;
    app.metrics.observe_latency_ms(latency_ms);
    let text = std::str::from_utf8(&bytes).ok();
    let parsed = text.and_then(capture::parse_response);
    let Some(capture::Response { obj: mut resp_obj, choices, raw: known_raw }) = parsed else {
        // Not a JSON object: forwarded verbatim, nothing recorded.
        return raw_response(status, content_type, bytes);
    };
    if !status.is_success() {
        app.metrics.calls_upstream_status_error.fetch_add(1, Ordering::Relaxed);
        return raw_response(status, content_type, bytes);
    }
    if let (Some(sid), Some(p), Some(text)) = (&sid, &prepared, text) {
        let trace_id = new_id();
        let facts = CallFacts {
            trace_id: &trace_id,
            session_id: sid,
            weight_version: dispatch_wv,
            latency_ms,
            timestamp: now(),
        };
        let response = match known_raw {
            Some(raw) => Ok(raw),
            None => capture::response_raw(&resp_obj, text),
        };
        let call = response.and_then(|response| {
            capture::record_from_response(&facts, &p.body, &p.raw, &resp_obj, choices.as_ref(), &response)
                .to_call(now())
        });
        if let Err(e) = capture(&app, call).await {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the call succeeded upstream but its trace was not stored: {e}"),
            );
        }
    }
    app.metrics.calls_ok.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(session = sid.as_deref().unwrap_or(""), path = %v1_path, %status, latency_ms, "call");
    let requested = prepared.as_ref().is_none_or(|p| p.requested_logprobs);
    if capture::sanitize_parsed(&mut resp_obj, choices, app.config.strip_vllm_fields, requested) {
        json_response(status, resp_obj.to_json())
    } else {
        raw_response(status, content_type, bytes)
    }
}

async fn read_body(app: &App, resp: reqwest::Response, timeout: Option<Duration>) -> Result<Bytes, Upstream> {
    // Sized once from Content-Length, not grown chunk by chunk (at most
    // 16 MiB up front: a header is not a body; the limit is checked as it comes).
    let hint = resp.content_length().unwrap_or(0).min(app.config.response_bytes_max as u64).min(16 << 20);
    let mut out = Vec::with_capacity(usize::try_from(hint).unwrap_or(0));
    let mut s = resp.bytes_stream();
    loop {
        match with_timeout(timeout, s.next()).await {
            None => return Err(Upstream::TimedOut),
            Some(None) => return Ok(Bytes::from(out)),
            Some(Some(Err(e))) => return Err(Upstream::Failed(e.to_string())),
            Some(Some(Ok(b))) => {
                if out.len() + b.len() > app.config.response_bytes_max {
                    return Err(Upstream::Failed(format!(
                        "response larger than {} bytes",
                        app.config.response_bytes_max
                    )));
                }
                out.extend_from_slice(&b);
            }
        }
    }
}

fn raw_response(status: StatusCode, content_type: Option<HeaderValue>, bytes: Bytes) -> Response {
    let mut r = Response::new(Body::from(bytes));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, content_type.unwrap_or(HeaderValue::from_static("application/json")));
    r
}

fn passthrough(resp: reqwest::Response, lease: Lease) -> Response {
    let status = resp.status();
    let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
    let s = resp.bytes_stream().map(move |b| {
        let _hold = &lease;
        b.map_err(std::io::Error::other)
    });
    let mut r = Response::new(Body::from_stream(s));
    *r.status_mut() = status;
    if let Some(ct) = ct {
        r.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    r
}

/// Forward an SSE stream line by line as it arrives, assembling the trace
/// from its `data:` chunks. `data: [DONE]` is held back until the trace is
/// stored, so a client that saw `[DONE]` has its call captured.
fn stream_response(
    app: Arc<App>,
    sid: Option<String>,
    prepared: Option<capture::Prepared>,
    resp: reqwest::Response,
    lease: Lease,
    dispatch_wv: Option<i64>,
) -> Response {
    let status = resp.status();
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let timeout = app.config.upstream_timeout();
    tokio::spawn(async move {
        let _lease = lease;
        let t0 = Instant::now();
        let requested = prepared.as_ref().is_none_or(|p| p.requested_logprobs);
        let strip = app.config.strip_vllm_fields;
        let mut asm = StreamAssembly::default();
        let mut pending: Vec<u8> = Vec::new();
        let mut done_seen = false;
        let mut upstream = resp.bytes_stream();
        let failure: Option<String> = 'read: loop {
            let chunk = match with_timeout(timeout, upstream.next()).await {
                None => break 'read Some("upstream timed out mid-stream".into()),
                Some(None) => break 'read None,
                Some(Some(Err(e))) => break 'read Some(format!("upstream failed mid-stream: {e}")),
                Some(Some(Ok(b))) => b,
            };
            app.metrics.response_bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            pending.extend_from_slice(&chunk);
            let mut out = Vec::new();
            while let Some(pos) = pending.iter().position(|&c| c == b'\n') {
                let line: Vec<u8> = pending.drain(..=pos).collect();
                sse_line(&line[..line.len() - 1], &mut asm, &mut out, &mut done_seen, strip, requested);
            }
            if !out.is_empty() && tx.send(Ok(Bytes::from(out))).await.is_err() {
                app.metrics.calls_client_gone.fetch_add(1, Ordering::Relaxed);
                tracing::info!("client went away mid-stream; nothing recorded");
                return;
            }
        };
        if let Some(e) = failure {
            app.metrics.calls_upstream_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "stream cut; nothing recorded");
            let _ = tx.send(Err(std::io::Error::other(e))).await;
            return;
        }
        if !pending.is_empty() {
            let mut out = Vec::new();
            let line = std::mem::take(&mut pending);
            sse_line(&line, &mut asm, &mut out, &mut done_seen, strip, requested);
            if !out.is_empty() && tx.send(Ok(Bytes::from(out))).await.is_err() {
                app.metrics.calls_client_gone.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let latency_ms = t0.elapsed().as_secs_f64() * 1000.0;
        app.metrics.observe_latency_ms(latency_ms);
        if let (Some(sid), Some(p)) = (&sid, &prepared) {
            if !asm.is_empty() {
                if tx.is_closed() {
                    app.metrics.calls_client_gone.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let trace_id = new_id();
                let facts = CallFacts {
                    trace_id: &trace_id,
                    session_id: sid,
                    weight_version: dispatch_wv,
                    latency_ms,
                    timestamp: now(),
                };
                let call = asm.record(&facts, &p.body, &p.raw).to_call(now());
                if let Err(e) = capture(&app, call).await {
                    let msg = format!("data: {{\"error\":{}}}\n\n", json::string(&format!("trace not stored: {e}")));
                    let _ = tx.send(Ok(Bytes::from(msg))).await;
                    let _ = tx.send(Err(std::io::Error::other(e))).await;
                    return;
                }
            }
        }
        app.metrics.calls_ok.fetch_add(1, Ordering::Relaxed);
        if done_seen {
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    let mut r = Response::new(Body::from_stream(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// One SSE line (without its `\n`), as rLLM's event generator handles it (contract §2.4).
fn sse_line(
    line: &[u8],
    asm: &mut StreamAssembly,
    out: &mut Vec<u8>,
    done_seen: &mut bool,
    strip: bool,
    requested: bool,
) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return;
    }
    if let Some(data) = line.strip_prefix(b"data: ") {
        let data = std::str::from_utf8(data).map(str::trim);
        if data == Ok("[DONE]") {
            *done_seen = true;
            return;
        }
        if let Some(mut chunk) = data.ok().and_then(Obj::parse) {
            let choices = capture::parse_choices(&chunk);
            asm.push_parsed(&chunk, choices.as_ref());
            out.extend_from_slice(b"data: ");
            if capture::sanitize_parsed(&mut chunk, choices, strip, requested) {
                out.extend_from_slice(chunk.to_json().as_bytes());
            } else {
                out.extend_from_slice(data.unwrap_or("").as_bytes());
            }
            out.extend_from_slice(b"\n\n");
            return;
        }
    }
    out.extend_from_slice(line);
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode() {
        assert_eq!(percent_decode("a%2Fb%3a"), "a/b:");
        assert_eq!(percent_decode("100%"), "100%");
    }

    #[test]
    fn weight_version_like_python_int() {
        let r = |t: &str| serde_json::value::RawValue::from_string(t.to_owned()).ok().and_then(|v| python_int(&v));
        assert_eq!(r("7"), Some(7));
        assert_eq!(r("\"7\""), Some(7));
        assert_eq!(r("7.9"), Some(7));
        assert_eq!(r("true"), Some(1));
        assert_eq!(r("\"abc\""), None);
        assert_eq!(r("\"7.5\""), None);
        assert_eq!(r("[]"), None);
    }
}
