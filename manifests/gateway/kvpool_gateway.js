// What a gateway must do before vLLM sees a request when the connector trusts request parameters
// (trust_request_params: true): the caller's tenant and class come from its credential, never from the
// body. Every client-supplied kv_transfer_params and cache_salt is replaced; a body that is not a JSON
// object nesting at most MAX_DEPTH levels is refused here (vLLM 0.32 dies on a 500-deep body; njs's own
// parser may stop sooner, with the same answer).
var MAX_DEPTH = 32;
var BODY_RULE = 'must be a JSON object nesting at most ' + MAX_DEPTH + ' levels';

function depth(v) {
    if (v === null || typeof v !== 'object') {
        return 0;
    }
    var deepest = 0;
    var keys = Object.keys(v);
    for (var i = 0; i < keys.length; i++) {
        deepest = Math.max(deepest, depth(v[keys[i]]));
    }
    return deepest + 1;
}

function refuse(r, status, field, rule) {
    r.headersOut['Content-Type'] = 'application/json';
    r.return(status, JSON.stringify({error: {field: field, rule: rule}}) + '\n');
}

// The caller: "<tenant> <class>" from the map of API keys (kvpool-gateway.conf), or "".
function caller(r) {
    var who = (r.variables.kvpool_caller || '').split(' ');
    return who.length === 2 ? {tenant: who[0], workload_class: who[1]} : null;
}

// Content phase of /v1/: authenticate, validate, then hand over to @engine with the rewritten body.
function admit(r) {
    var who = caller(r);
    if (who === null) {
        refuse(r, 401, 'Authorization', 'a known API key is required: Authorization: Bearer <key>');
        return;
    }
    if (r.method === 'POST') {
        var body;
        try {
            body = JSON.parse(r.requestText || '');
        } catch (e) {
            refuse(r, 400, 'body', BODY_RULE + ' (' + e.message + ')');
            return;
        }
        if (body === null || typeof body !== 'object' || Array.isArray(body) || depth(body) > MAX_DEPTH) {
            refuse(r, 400, 'body', BODY_RULE);
            return;
        }
    }
    r.internalRedirect('@engine');
}

// proxy_set_body of @engine: the client's body with the caller's own parameters.
function body(r) {
    if (r.method !== 'POST') {
        return '';
    }
    var who = caller(r);
    var req = JSON.parse(r.requestText);
    req.kv_transfer_params = who;
    req.cache_salt = who.tenant;  // isolates vLLM's own cache per tenant (mixed into its block hashes)
    return JSON.stringify(req);
}

export default {admit: admit, body: body};
