// Preloaded into NNI's node process by `parnas launch` (NODE_OPTIONS=--require): a server given a port but no
// address listens on 127.0.0.1 only, instead of on every interface as Node does by default. NNI 3.0's manager
// calls `app.listen(port)` for its web UI and REST API, which have no authentication; an address passed
// explicitly is left alone.
'use strict';
const net = require('net');

const LOOPBACK = '127.0.0.1';
const listen = net.Server.prototype.listen;

net.Server.prototype.listen = function (...args) {
  const first = args[0];
  if (first === undefined || typeof first === 'function') {  // listen() or listen(callback): a random port
    args.unshift(0, LOOPBACK);
  } else if (typeof first === 'number' || (typeof first === 'string' && /^\d+$/.test(first))) {
    if (typeof args[1] !== 'string') args.splice(1, 0, LOOPBACK);  // listen(port[, backlog][, callback])
  } else if (first && typeof first === 'object' && first.port !== undefined && first.host === undefined
             && first.path === undefined) {  // listen({port, ...})
    args[0] = { ...first, host: LOOPBACK };
  }
  return listen.apply(this, args);
};
