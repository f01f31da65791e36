//! A deterministic simulator of multi-turn agent rollouts, used by
//! `trajlog demo`, `trajlog generate`, `trajlog bench`, the tests and the
//! benchmarks.
//!
//! Each session is a rollout of a task (`task-<t>:<rollout>`): the first prompt
//! is the task's system prompt, and every later prompt is the previous prompt,
//! the model's completion and a tool result — so prompts extend each other
//! exactly (TI/TO). Sessions chosen by `break_every` get one deliberate
//! retokenization: two completion tokens are merged into one in the next
//! prompt, a TI/TO break at a known position.
//!
//! What a call carries besides its token columns is its [`Shape`]: by default
//! the record rLLM's model gateway stores for a non-streaming chat call (the
//! whole chat history with tool calls and tool results, the request and
//! vLLM's whole response; see [`gateway`]), or the streaming variant, or the
//! lean calls of trajlog's earlier workload. The token columns of a session
//! are the same in every shape (the documents draw on a random stream of
//! their own), and so is the break: a retokenization changes the tokens of
//! the history, not its text, so `messages` grows without a break.

pub mod gateway;
pub mod pyjson;
#[cfg(test)]
mod tests;

pub use gateway::gateway_json;
pub use trajlog::trace_json::TRACE_KEYS;
use trajlog::Call;

/// Small, fast, deterministic PRNG (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next_u64() % 151_000) as u32).collect()
    }
    pub fn logprobs(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| -((self.next_u64() % 1_000_000) as f32 / 200_000.0)).collect()
    }
}

/// What each simulated call carries besides its token columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Shape {
    /// As rLLM's model gateway stores a non-streaming chat call
    /// (docs/serve-contract.md §3.1–3.2): the 17 keys of its `TraceRecord`;
    /// `messages` the whole chat history (system, user, assistant messages
    /// with tool calls, tool results), `response_message` vLLM's message,
    /// `raw_request` the request body after the gateway's injections,
    /// `raw_response` vLLM's whole response (the prompt and completion ids
    /// and one `logprobs.content[]` entry per generated token again, `usage`),
    /// `token_counts`, `metadata: {}`, a UUID `trace_id`.
    #[default]
    Gateway,
    /// As the gateway stores a streaming chat call (§3.3): the same keys, with
    /// `raw_response` null, `token_counts` `{}` and `response_message`
    /// assembled from the deltas.
    GatewayStreaming,
    /// trajlog's earlier workload: a one-line `messages`, a short
    /// `response_message`, `metadata` with the group id and step, no raw bodies.
    Lean,
}

impl Shape {
    /// Every shape, default first.
    pub const ALL: [Shape; 3] = [Shape::Gateway, Shape::GatewayStreaming, Shape::Lean];

    /// The name `FromStr` takes (`gateway`, `gateway-streaming`, `lean`).
    pub fn name(self) -> &'static str {
        match self {
            Shape::Gateway => "gateway",
            Shape::GatewayStreaming => "gateway-streaming",
            Shape::Lean => "lean",
        }
    }

    /// A phrase for reports: what the calls carry.
    pub fn describe(self) -> &'static str {
        match self {
            Shape::Gateway => "rLLM gateway traces: chat history with tool calls, raw request and vLLM's raw response",
            Shape::GatewayStreaming => {
                "rLLM gateway traces of streaming calls: chat history with tool calls, raw request, raw_response null"
            }
            Shape::Lean => "lean calls: token columns, one-line messages, no raw bodies",
        }
    }
}

impl Shape {
    /// The JSON text rLLM stores for `call` (one blob per call): the gateway's
    /// record ([`gateway_json`]) for the gateway shapes, trajlog's export in
    /// the gateway shape ([`trajlog::trace_json::export_call`]) for lean calls.
    pub fn trace_json(self, call: &Call) -> String {
        match self {
            Shape::Gateway | Shape::GatewayStreaming => gateway_json(call),
            Shape::Lean => trajlog::trace_json::export_call(call),
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Shape::ALL
            .into_iter()
            .find(|shape| shape.name() == s)
            .ok_or_else(|| format!("{s:?} is not a shape; use gateway, gateway-streaming or lean"))
    }
}

/// Shape of a simulated batch.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub sessions: usize,
    pub steps: usize,
    /// Rollouts per task (GRPO group size).
    pub rollouts_per_task: usize,
    pub system_tokens: usize,
    pub completion_tokens: (usize, usize),
    pub tool_tokens: (usize, usize),
    /// Every n-th session gets one TI/TO break (0: none).
    pub break_every: usize,
    pub seed: u64,
    /// What each call carries besides its token columns.
    pub shape: Shape,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            sessions: 64,
            steps: 8,
            rollouts_per_task: 4,
            system_tokens: 1500,
            completion_tokens: (200, 600),
            tool_tokens: (100, 400),
            break_every: 5,
            seed: 42,
            shape: Shape::default(),
        }
    }
}

/// A simulated session: its calls in order and the injected break, if any
/// (`(call index, prompt position)`).
#[derive(Debug, Clone)]
pub struct SimSession {
    pub session_id: String,
    pub calls: Vec<Call>,
    pub injected_break: Option<(usize, usize)>,
}

/// Generate the sessions of `cfg`.
pub fn simulate(cfg: &SimConfig) -> Vec<SimSession> {
    (0..cfg.sessions).map(|s| simulate_session(cfg, s)).collect()
}

/// The model every simulated call names.
pub const MODEL: &str = "Qwen/Qwen3-8B";

/// Generate session number `s` of `cfg` alone (for streaming large batches).
pub fn simulate_session(cfg: &SimConfig, s: usize) -> SimSession {
    let task = s / cfg.rollouts_per_task.max(1);
    let rollout = s % cfg.rollouts_per_task.max(1);
    let session_id = format!("task-{task}:{rollout}");
    let system = Rng::new(cfg.seed ^ (task as u64) << 20).tokens(cfg.system_tokens);
    let mut rng = Rng::new(cfg.seed.wrapping_mul(31).wrapping_add(s as u64));
    let break_at = (cfg.break_every > 0 && s % cfg.break_every == cfg.break_every - 1 && cfg.steps > 1)
        .then(|| rng.range(1, cfg.steps - 1));
    // The documents' own random stream: the token stream (`rng`) is the same in every shape.
    let mut conversation = match cfg.shape {
        Shape::Lean => None,
        shape => Some(gateway::Conversation::new(
            shape == Shape::GatewayStreaming,
            cfg.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ (s as u64).wrapping_add(0xd0c5),
            cfg.completion_tokens.1,
            &system,
        )),
    };
    let mut injected_break = None;
    let mut prompt = system;
    let mut calls = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let n = rng.range(cfg.completion_tokens.0, cfg.completion_tokens.1);
        let completion = rng.tokens(n);
        let logprobs = rng.logprobs(n);
        let timestamp = 1_700_000_000.0 + s as f64 * 0.001 + step as f64;
        let latency_ms = rng.range(50, 900) as f64;
        let call = match &mut conversation {
            Some(conversation) => conversation.call(&gateway::Turn {
                session_id: &session_id,
                model: MODEL,
                weight_version: 3,
                prompt: &prompt,
                completion: &completion,
                logprobs: &logprobs,
                timestamp,
                latency_ms,
                last: step + 1 == cfg.steps,
            }),
            None => Call {
                trace_id: format!("{session_id}/{step}"),
                session_id: session_id.clone(),
                timestamp,
                model: Some(MODEL.into()),
                weight_version: Some(3),
                prompt_token_ids: prompt.clone(),
                completion_token_ids: completion.clone(),
                logprobs: Some(logprobs),
                finish_reason: Some("stop".into()),
                latency_ms: Some(latency_ms),
                messages: Some(
                    format!(r#"[{{"role":"user","content":"solve task {task}, turn {step}"}}]"#).into_bytes(),
                ),
                response_message: Some(br#"{"role":"assistant","content":"..."}"#.to_vec()),
                metadata: Some(format!(r#"{{"group_id":"task-{task}","step":{step}}}"#).into_bytes()),
                ..Default::default()
            },
        };
        calls.push(call);
        let tool_len = rng.range(cfg.tool_tokens.0, cfg.tool_tokens.1);
        let tool = rng.tokens(tool_len);
        if let Some(conversation) = &mut conversation {
            conversation.tool_result(&tool);
        }
        let mut next = prompt;
        if break_at == Some(step + 1) && completion.len() >= 4 {
            // Retokenization: two generated tokens come back as one.
            let p = completion.len() / 2;
            injected_break = Some((step + 1, next.len() + p));
            next.extend_from_slice(&completion[..p]);
            next.push(completion[p].wrapping_add(completion[p + 1]) % 151_000 + 1);
            next.extend_from_slice(&completion[p + 2..]);
        } else {
            next.extend_from_slice(&completion);
        }
        next.extend_from_slice(&tool);
        prompt = next;
    }
    SimSession { session_id, calls, injected_break }
}
