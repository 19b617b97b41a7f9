// Starts Swagger UI on /docs from the OpenAPI document the page names; served from 'self' (no inline script).
"use strict";
window.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.specUrl,
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,  // the default sends the document to validator.swagger.io
  });
});
