// A browser that used llama.cpp's web UI at this address keeps its service worker, which would go on showing that
// page instead of this server's. Its update check fetches /sw.js: this worker replaces it and removes itself
// (llama-server answers the same when its own UI is off or replaced).
self.addEventListener('install', () => self.skipWaiting());
self.addEventListener('activate', (e) => e.waitUntil((async () => {
    await self.registration.unregister();
    for (const key of await caches.keys()) await caches.delete(key);
    for (const c of await self.clients.matchAll({ type: 'window' })) c.navigate(c.url);
})()));
